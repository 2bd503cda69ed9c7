import os, sys, torch
if os.environ.get("NO_INT8_HEAD"):
    from specula.drafters import int8_weights
    int8_weights.linear = lambda m, x: m(x)
mode = os.environ.get("HEAD")
if mode:
    from specula.drafters import text_lm, int8_weights
    init = text_lm.TextLMDrafter.__init__
    def patched(self, *a, **k):
        init(self, *a, **k)
        h = self._head
        if isinstance(h, torch.nn.Linear):
            if mode == "int8":
                self._head = lambda x, h=h: int8_weights.linear(h, x)
            elif mode == "bf16":
                wb = h.weight.detach().bfloat16()
                self._head = lambda x, wb=wb: torch.nn.functional.linear(x.bfloat16(), wb).float()
    text_lm.TextLMDrafter.__init__ = patched
from specula.cli import main
sys.exit(main(sys.argv[1:]))
