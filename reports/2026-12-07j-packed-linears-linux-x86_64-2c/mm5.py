import torch, time
torch.set_num_threads(2)
w = torch.randn(1024, 384)
pw = torch.ops.mkldnn._reorder_linear_weight(w, 8)
for M in (1, 3, 158, 600):
    x = torch.randn(M, 384)
    a = torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
    b = (x.double() @ w.double().t()).float()
    c = torch.nn.functional.linear(x, w)
    print(M, (a-b).abs().max().item(), (c-b).abs().max().item())
x = torch.randn(4000, 384)
t=time.perf_counter()
for _ in range(20): torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
dt=(time.perf_counter()-t)/20
print("GFLOP/s dnn", 2*4000*384*1024/dt/1e9)
t=time.perf_counter()
for _ in range(20): torch.nn.functional.linear(x, w)
dt=(time.perf_counter()-t)/20
print("GFLOP/s mkl", 2*4000*384*1024/dt/1e9)
print(torch.backends.cpu.get_cpu_capability())
