"""The runtime's configuration: one validated document (pydantic v2, YAML on disk) for the whole application.

Every field has a description and unknown keys are an error, so a typo fails at load time with the field's path::

    cfg = load_config("specula.yaml")          # or a dict, or an already built SpeculaConfig
    cfg.deployments.target_verifier.device     # "cpu" | "cuda" | "cuda:N"

A minimal file (everything else has a default)::

    model: {path: target}                      # a zoo entry name or a local checkpoint directory
    drafter: {kind: ngram, options: {max_n: 3}, gamma: 4}
    deployments:
      target_verifier: {device: cuda, ray_actor_options: {num_gpus: 1}}

``specula.runtime.serve.builder.build_app`` turns it into the Serve application; the same document is the
``args`` of a ``serve deploy`` config (see cluster.yaml).

CPU reservations: a deployment's ``ray_actor_options.num_cpus`` left null is sized from the CPUs Ray sees when the
application is built (``specula.runtime.serve.placement.size_reservations``): the cluster's CPUs are shared out,
ingress : vision_encoder : drafter_ensemble : target_verifier = 1 : 1 : 1 : 2 per replica, after any explicit
reservations, counting only the deployments that run, so the whole application always fits (0.4 / 0.4 / 0.4 / 0.8
CPUs on a 2-CPU machine with all four; ingress 0.6666 / verifier 1.0 with the default one-machine colocation). An explicit
value is honoured as given. ``torch_threads`` left null follows the replica's reservation (its whole CPUs, at least
one), so replicas sharing a small machine do not oversubscribe it.

Checked at load time, naming the field: ``model.path`` exists (a local directory or a shipped zoo entry) and every
drafter ``kind`` is a registered one.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_DEVICE = re.compile(r"^(cpu|cuda|cuda:\d+)$")


class ConfigError(ValueError):
    """A configuration that does not validate; the message names every bad field by its dotted path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# ----------------------------------------------------------------------------------------------- deployments


class AutoscalingConfig(_Strict):
    """Serve's replica autoscaling on ongoing requests (the subset Specula sets; Serve's defaults for the rest)."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept running (0 allows scaling to zero).")
    max_replicas: int = Field(1, ge=1, description="Most replicas the autoscaler may start.")
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="Ongoing requests per replica the autoscaler aims for; more scales up, fewer down.")
    upscale_delay_s: float = Field(30.0, ge=0, description="How long demand must stay high before adding replicas.")
    downscale_delay_s: float = Field(
        600.0, ge=0, description="How long demand must stay low before removing replicas.")
    look_back_period_s: float = Field(
        30.0, gt=0, description="Window over which Serve averages ongoing requests before deciding (shorter reacts "
                                "faster, longer is steadier).")

    @model_validator(mode="after")
    def _order(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        return self


class ActorOptions(_Strict):
    """Resources Ray reserves for each replica; ``num_gpus`` is what puts the deployments on separate GPUs."""

    num_cpus: float | None = Field(
        None, ge=0, description="CPUs reserved per replica; null = sized from the CPUs Ray sees when the application "
                                "is built (the cluster's CPUs, less explicit reservations, shared out ingress 1 : "
                                "vision_encoder 1 : drafter_ensemble 1 : target_verifier 2 per replica, so the "
                                "application fits the machine it starts on); 0 = do not reserve.")
    num_gpus: float = Field(
        0.0, ge=0, description="GPUs reserved per replica; Ray sets CUDA_VISIBLE_DEVICES to them, so 'cuda' in "
                               "the replica means its own GPU. Needed (>0) for a cuda device.")


class DeploymentSettings(_Strict):
    """Placement and scaling of one Serve deployment."""

    num_replicas: int | None = Field(
        1, ge=1, description="Fixed replica count; set to null when autoscaling_config is given.")
    autoscaling_config: AutoscalingConfig | None = Field(
        None, description="Autoscale on ongoing requests instead of a fixed num_replicas.")
    ray_actor_options: ActorOptions = Field(
        default_factory=ActorOptions, description="Ray resources reserved per replica.")
    max_ongoing_requests: int = Field(
        16, ge=1, description="Requests one replica takes at once; more wait in Serve's queue (backpressure).")
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads in each replica; null = the replica's reserved CPUs, rounded "
                                "down, at least 1 (torch's default while num_cpus is still null, i.e. outside Serve).")

    @model_validator(mode="before")
    @classmethod
    def _autoscaling_replaces_replicas(cls, data: Any) -> Any:
        # giving autoscaling_config without num_replicas means "autoscale": drop the fixed default
        if isinstance(data, dict) and data.get("autoscaling_config") is not None and "num_replicas" not in data:
            data = {**data, "num_replicas": None}
        return data

    @model_validator(mode="after")
    def _one_way_to_scale(self) -> DeploymentSettings:
        if (self.num_replicas is None) == (self.autoscaling_config is None):
            raise ValueError("give exactly one of num_replicas and autoscaling_config")
        return self

    def threads(self) -> int | None:
        """torch intra-op threads for a replica: ``torch_threads``, else its reserved whole CPUs (at least 1); None
        (torch's default) while the reservation is not sized yet."""
        if self.torch_threads is not None:
            return self.torch_threads
        cpus = self.ray_actor_options.num_cpus
        return None if cpus is None else max(1, int(cpus))

    def replicas_at_most(self) -> int:
        """The most replicas this deployment runs: ``num_replicas``, or the autoscaler's ``max_replicas``."""
        return self.num_replicas if self.autoscaling_config is None else self.autoscaling_config.max_replicas

    def serve_options(self) -> dict:
        """Keyword arguments for ``Deployment.options`` (what the builder passes to Serve); a null reservation is left
        to Ray's default (the builder sizes it first)."""
        opts: dict[str, Any] = {
            "ray_actor_options": self.ray_actor_options.model_dump(exclude_none=True),
            "max_ongoing_requests": self.max_ongoing_requests,
        }
        if self.autoscaling_config is not None:
            opts["autoscaling_config"] = self.autoscaling_config.model_dump()
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


class DeviceDeploymentSettings(DeploymentSettings):
    """A deployment that runs a model: placement and scaling plus the torch device it uses."""

    device: str = Field("cpu", description="Torch device of the replica's model: 'cpu', 'cuda' or 'cuda:N' "
                                           "(N counts the GPUs Ray gave this replica).")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not _DEVICE.match(v):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v

    @model_validator(mode="after")
    def _gpu_reserved(self) -> DeviceDeploymentSettings:
        if self.device != "cpu":
            gpus = self.ray_actor_options.num_gpus
            if gpus <= 0:
                raise ValueError(f"device {self.device!r} needs ray_actor_options.num_gpus > 0 (Ray hides unreserved "
                                 "GPUs from a replica)")
            index = int(self.device.split(":")[1]) if ":" in self.device else 0
            if index >= math.ceil(gpus):
                raise ValueError(f"device {self.device!r} is beyond the {gpus:g} GPU(s) reserved per replica")
        return self


class VisionSettings(DeviceDeploymentSettings):
    """The VisionEncoder deployment: pixels -> projected visual embeddings, batched across requests."""

    max_batch_size: int = Field(8, ge=1, description="Images of concurrent requests encoded in one forward pass.")
    batch_wait_timeout_s: float = Field(
        0.005, ge=0, description="How long the first request of a batch waits for company.")
    colocate: bool | None = Field(
        None, description="Encode images inside each TargetVerifier replica (its target's own vision tower, as "
                          "`specula generate` does) instead of in VisionEncoder replicas: no VisionEncoder "
                          "deployment, no extra hop per image request (about 17 ms per request measured on 2 CPUs). "
                          "null = decided when the application is built: colocated when the vision encoder and the "
                          "verifier both run on the CPU of a one-node cluster, separate otherwise (GPUs, clusters). "
                          "The other fields of this section apply only to a separate vision encoder.")
    pre_projector: bool = Field(
        True, description="Also return the tower's pre-projector features (what massv, caption, pooled and "
                          "ensemble drafters feed their own projector), so the verifier never runs the vision tower "
                          "again for them; the verifier drops them when its drafter does not need them. Costs "
                          "D_vis / H more bytes per image between the two deployments.")


class VerifierSettings(DeviceDeploymentSettings):
    """The TargetVerifier deployment: prefill, then the decode loop of each request (its KV cache stays here)."""

    max_batch_size: int = Field(
        16, ge=1, description="Live requests decoded together (continuous batching); more wait to join.")
    stream_interval_ms: float = Field(
        20.0, ge=0, description="Least time between two chunks of one request's stream from the verifier to the "
                                "ingress: the tokens of the decoding steps in between travel as one chunk (each "
                                "chunk is a Ray streaming message, and one per step costs the decode loop's CPU on "
                                "a small machine). A request's first token and its last chunk are never held "
                                "back; an answer read only once whole (not streamed, no stop strings) travels as "
                                "those two chunks alone. 0 = one chunk per decoding step.")
    in_ingress: bool | None = Field(
        None, description="Run the verifier's engine (the target, each request's decode loop and its KV cache) "
                          "inside each Ingress replica instead of in TargetVerifier replicas: no TargetVerifier "
                          "deployment, no Ray call and stream between the ingress and the verifier per request. "
                          "null = decided when the application is built: inside when the verifier runs on the CPU "
                          "of a one-node cluster with one replica, no autoscaling and no ray_actor_options.num_cpus "
                          "/ num_gpus of its own; separate otherwise (GPUs, clusters, scaled or reserved "
                          "verifiers). true needs device cpu; the Ingress replicas then are the verifiers "
                          "(deployments.ingress sets their number and CPUs) and this section's ray_actor_options, "
                          "num_replicas and autoscaling_config do not apply; its device, torch_threads, "
                          "max_batch_size and stream_interval_ms do.")

    @model_validator(mode="after")
    def _in_ingress_on_cpu(self) -> VerifierSettings:
        if self.in_ingress and self.device != "cpu":
            raise ValueError(f"in_ingress: true runs the verifier on the ingress replica's CPU; device {self.device!r} "
                             "needs its own TargetVerifier deployment (in_ingress: false or null)")
        return self


class Deployments(_Strict):
    """The four Serve deployments of the application."""

    ingress: DeploymentSettings = Field(
        default_factory=lambda: DeploymentSettings(max_ongoing_requests=64),
        description="HTTP ingress: validation, chat template, tokenization, streaming the answer.")
    vision_encoder: VisionSettings = Field(default_factory=VisionSettings, description="VisionEncoder deployment.")
    drafter_ensemble: DeviceDeploymentSettings = Field(
        default_factory=DeviceDeploymentSettings,
        description="DrafterEnsemble deployment: each replica runs a DrafterService gRPC server.")
    target_verifier: VerifierSettings = Field(
        default_factory=VerifierSettings, description="TargetVerifier deployment.")


# ----------------------------------------------------------------------------------------------- the rest


class ModelConfig(_Strict):
    """The target model."""

    path: str = Field("target", description="A shipped zoo entry name (e.g. 'target') or a local HF checkpoint "
                                            "directory (LLaVA, Qwen2.5-VL); never fetched from a hub.")
    dtype: str | None = Field(None, description="Compute dtype ('float32', 'float16', 'bfloat16'); null = the "
                                                "checkpoint's.")
    image_parts_first: bool | None = Field(
        None, description="Move each user message's images in front of its text before the chat template (only a "
                          "message whose images form one run; interleaved ones keep their order), the order LLaVA "
                          "targets were trained on: the embedded target answers VQA 0.91 with the image first and "
                          "0.02 with the question before it. null = on for LLaVA targets, off for Qwen2.5-VL.")
    packed_linears: bool | None = Field(
        None, description="Run the target's CPU linear layers through oneDNN on weights reordered once at load "
                          "(the same fp32 / bf16 products; 1.5-2x faster prefill, decode and verify on this "
                          "project's machine, whose MKL takes a slow path), at the cost of a second copy of those "
                          "weights. null = on for a CPU target whose linear weights fit 1 GiB; no effect on a GPU.")

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        from specula.zoo.store import resolve, shipped

        try:
            resolve(v)
        except FileNotFoundError:
            raise ValueError(f"{v} does not exist (neither a local directory nor a shipped zoo entry: "
                             f"{', '.join(shipped()) or 'none shipped'})") from None
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str | None) -> str | None:
        if v is not None and v not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {v!r}")
        return v


class AlternativeDrafter(_Strict):
    """One more drafter the DrafterEnsemble serves next to the default one; a request chooses it by name."""

    kind: str = Field(description="Drafter registry key (specula.drafters.kinds()), e.g. 'eagle'.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of that drafter, as for the default drafter's.")

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str | None) -> str | None:
        return None if v is None else _drafter_kind(v)


class DrafterConfig(_Strict):
    """Which drafter(s) the DrafterEnsemble runs and how the verifier uses them.

    One drafter by default; with ``alternatives`` a request may choose another by name (its ``drafter`` field)::

        drafter:
          kind: ngram                      # the default, chosen by name "ngram" (or by ``name``) or by none
          options: {max_n: 3}
          gamma: 8                         # at most, shared by every drafter
          alternatives:
            eagle: {kind: eagle, options: {path: /models/eagle}}
            ngram_long: {kind: ngram, options: {max_n: 6}}
    """

    kind: str | None = Field(
        None, description="Drafter registry key (specula.drafters.kinds()), e.g. 'ngram'. null = the best measured "
                          "drafter for model.path: 'flash' with its shipped weights where they were trained for "
                          "this model (the embedded target; bench served / bench report; there 'msd' also serves "
                          "requests without images, see text_only), else 'ngram', which needs no weights (also when "
                          "options are given without a kind).")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of that drafter (see its class); 'vocab_size' and "
                                          "'image_token_id' default to the target's when the drafter takes them.")
    name: str | None = Field(
        None, description="The name a request gives (its `drafter` field) to choose this, the default drafter; "
                          "null = its kind. A request that names no drafter gets the default.")
    alternatives: dict[str, AlternativeDrafter] = Field(
        default_factory=dict,
        description="More drafters served next to the default one, by name: a request naming one (OpenAI extension "
                    "field `drafter`, gRPC GenerateRequest.drafter, POST /generate `drafter`) drafts with it. Every "
                    "DrafterEnsemble replica loads them all. gamma, codecs, timeouts and overlap are shared (overlap "
                    "applies to the requests whose drafter can draft ahead). Names: 1-64 letters, digits, '_', '.', "
                    "'-', not 'none' and not the default drafter's name.")
    text_only: str | None = Field(
        None, description="The drafter, by name (the default's or an alternative's), that requests with no image or "
                          "video draft with when they name none; null = the default drafter for every request. "
                          "Left null with a null kind on the embedded target: 'msd' (an alternative added for it), "
                          "the best measured drafter on text-only prompts there (bench spec --suite text: 1.72x "
                          "against flash's 1.32x), while image requests keep 'flash'. Lossless either way.")
    gamma: int = Field(8, ge=0, le=64, description="Draft tokens per block at most (nodes for tree drafters); 0 = no "
                                                   "drafting (plain target decoding). A colocated drafter with "
                                                   "`adaptive` drafts 0..gamma per step, as long as the blocks pay "
                                                   "(captions run to 8, one-word answers to 0); a separate drafter "
                                                   "drafts gamma every step (4 or 5 suits it better).")
    accept_codecs: list[str] = Field(
        default_factory=lambda: ["fp32", "fp16", "bf16", "int8", "fp16+lz4", "int8+zstd"],
        description="Codecs the drafter decodes for the target features it receives (raw is always accepted).")
    codec_preference: list[str] = Field(
        default_factory=lambda: ["fp32"],
        description="The verifier's codec order for features it sends; the first one the drafter accepts wins. "
                    "Lossy codecs only change what the drafter sees, never the output.")
    propose_timeout_s: float = Field(
        2.0, gt=0, description="How long the verifier waits for a block's proposals; a drafter session slower "
                               "than this is dropped and its request decodes alone (gamma = 0), output unchanged.")
    connect_timeout_s: float = Field(
        2.0, gt=0, description="Deadline for reaching a drafter replica (Describe) before decoding alone.")
    address_timeout_s: float = Field(
        5.0, gt=0, description="Deadline for asking Serve which drafter replica serves a new request.")
    overlap: bool = Field(
        True, description="Draft block n+1 while the verifier verifies block n, assuming block n is accepted whole "
                          "(PEARL's post-verify); the pre-drafted block is used when the verdict agrees and dropped "
                          "otherwise. Lossless either way. Only drafters that can draft ahead (chains of ngram, "
                          "text_lm, eagle, msd) do it; others draft sequentially. Drafters that also need nothing "
                          "of the target's prefill (ngram, text_lm) begin before it (early Begin), so their prompt "
                          "prefill and first block overlap the target's prefill.")
    predraft: int = Field(
        3, ge=0, le=16,
        description="With overlap, blocks also drafted per block for the likeliest rejection outcomes (SSD / "
                    "Saguaro): 'd_0..d_{k-1} accepted, the target's token at k is t', ranked by the drafter's own "
                    "probabilities; a verdict with that outcome gets its next block at once. Uses drafter time "
                    "only while it waits for the verdict; drafters that grow a row's chains side by side "
                    "draft every branch in about the time of one block. Drafters that can rank outcomes (text_lm, "
                    "eagle and msd chains) do it; "
                    "0 turns it off. Lossless either way.")
    adaptive: bool = Field(
        True, description="Choose each step's draft length in 0..gamma by expected goodput (runtime/engine/"
                          "adaptive.py): per-request acceptance and the measured cost of drafting and of verifying "
                          "the batch, so speculation backs off for requests whose drafts are rejected and as the "
                          "batch grows (to plain steps), and comes back; one step in 32 drafts a probe length, so "
                          "the measured costs stay current. Applies to a colocated drafter; a separate drafter "
                          "drafts gamma every step. Lossless either way.")
    begin_after: int = Field(
        2, ge=0, le=1024,
        description="A request's drafter begins once its answer has this many tokens (0 or 1: right after the "
                    "prefill); until then it decodes plainly and the drafter catches up on those steps when it "
                    "begins. One-word answers (a VQA 'yes' and its end token) then never pay the drafter's prompt "
                    "prefill or a block; a long answer pays one plain step or so. Applies to a colocated drafter; "
                    "a separate drafter begins with the target's prefill. Lossless either way.")
    colocate: bool | None = Field(
        None, description="Run the drafter inside each TargetVerifier replica (no DrafterEnsemble deployment, no "
                          "data plane: drafts and target features never leave the process, as in `specula "
                          "generate`) instead of in DrafterEnsemble replicas reached over gRPC. null = decided when "
                          "the application is built: colocated when the drafter and the verifier both run on the "
                          "CPU of a one-node cluster (a laptop, where a second process only adds hand-offs and "
                          "competes for the same cores), separate otherwise (GPUs, clusters). overlap, predraft, "
                          "offers, codecs and the timeouts apply only to a separate drafter.")
    offers: bool = Field(
        True, description="With overlap, the drafter sends each block it drafted ahead as soon as it is whole, "
                          "with the verdict it is for (an Offer); the verifier verifies a matching one at once "
                          "instead of asking for it, so a block drafted ahead costs no round trip. Lossless either "
                          "way; false = the verifier always asks (ProposeRequest -> Proposal).")

    @field_validator("accept_codecs", "codec_preference")
    @classmethod
    def _codecs(cls, v: list[str]) -> list[str]:
        from specula.runtime.wire import WireError, parse_codec

        if not v:
            raise ValueError("needs at least one codec")
        try:
            return [parse_codec(c).name for c in v]
        except WireError as e:
            raise ValueError(str(e)) from None

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str | None) -> str | None:
        return None if v is None else _drafter_kind(v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        from specula.drafters.multi_drafter import check_name

        return None if v is None else check_name(v)

    @field_validator("alternatives")
    @classmethod
    def _alternative_names(cls, v: dict) -> dict:
        from specula.drafters.multi_drafter import check_name

        for name in v:
            check_name(name)
        return v

    @model_validator(mode="after")
    def _distinct(self) -> DrafterConfig:
        if self.default_name in self.alternatives:
            raise ValueError(f"alternatives: {self.default_name!r} is the default drafter's name; name the "
                             "alternative differently (or set drafter.name)")
        if self.text_only is not None and self.text_only not in self.names():
            raise ValueError(f"text_only: {self.text_only!r} is not a drafter served here; name one of "
                             f"{list(self.names())} (add it under drafter.alternatives)")
        return self

    @property
    def default_name(self) -> str:
        """The name that chooses the default drafter: ``name``, else ``kind``."""
        return self.name or self.kind

    def names(self) -> tuple[str, ...]:
        """Every drafter a request may choose, the default first."""
        return (self.default_name, *self.alternatives)


def _drafter_kind(kind: str) -> str:
    # kinds() names the built-in drafters without importing them (and any registered since), so this stays cheap
    from specula.drafters.registry import kinds

    known = kinds()
    if kind not in known:
        raise ValueError(f"{kind!r} is not a drafter kind; known: {', '.join(known)}")
    return kind


class DataplaneConfig(_Strict):
    """The verifier <-> drafter gRPC stream (DrafterService in protos/specula_dataplane.proto)."""

    host: str = Field("127.0.0.1", description="Address a DrafterService server binds; '0.0.0.0' on a cluster so "
                                               "verifiers on other nodes reach it.")
    port: int = Field(0, ge=0, le=65535, description="Port to bind; 0 = a free port picked per replica (needed "
                                                     "when several replicas share a node).")
    advertise_host: str | None = Field(
        None, description="Host the server reports to verifiers; null = host, or the node's IP when host is a "
                          "wildcard address.")
    max_message_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, lt=1 << 31, description="Largest serialized frame either side sends or accepts "
                                                          "(gRPC limit); bigger messages are chunked.")
    max_sessions: int = Field(64, ge=1, description="Concurrent sessions (requests) one drafter replica serves; "
                                                    "more are refused and those requests decode alone.")
    max_batch_size: int = Field(
        64, ge=1, description="Most requests (rows) in one drafter call: a drafter replica runs the pending calls of "
                              "all its sessions as batched calls (one propose over every session asking with the "
                              "same gamma); a bigger group runs as several calls.")
    batch_wait_ms: float = Field(
        0.0, ge=0, le=1000, description="How long the drafter replica's drafting worker waits, after the first "
                                        "pending call, for other sessions' calls to batch with it (milliseconds); "
                                        "0 = batch only what is pending at that moment (batches still form under "
                                        "load, while the drafter runs).")


class LimitsConfig(_Strict):
    """What the ingress accepts; a request outside these gets HTTP 400 naming the limit."""

    max_images: int = Field(8, ge=0, description="Images per request.")
    max_image_bytes: int = Field(8 * 1024 * 1024, ge=1, description="Encoded (decoded base64) bytes per image.")
    max_image_pixels: int = Field(4096 * 4096, ge=1, description="Width x height per image, checked before decoding.")
    max_request_bytes: int = Field(64 * 1024 * 1024, ge=1, description="Bytes of one HTTP request body.")
    max_prompt_tokens: int = Field(4096, ge=1, description="Prompt tokens after the chat template and image "
                                                           "expansion.")
    max_tokens: int = Field(1024, ge=1, description="Largest max_tokens a request may ask for.")
    max_concurrent_requests: int = Field(
        64, ge=1, description="Requests one ingress replica runs at once (HTTP and gRPC together); more wait in "
                              "the queue.")
    max_queued_requests: int = Field(
        64, ge=0, description="Requests that may wait for a slot per ingress replica; beyond it a request is "
                              "refused at once (HTTP 503 / RESOURCE_EXHAUSTED), never left hanging. The builder "
                              "raises the ingress's Serve max_ongoing_requests to at least max_concurrent_requests + "
                              "max_queued_requests + 16, so these limits, not Serve's queue, decide.")
    request_timeout_s: float | None = Field(
        None, gt=0, description="Default deadline of a request in seconds (HTTP 408 / DEADLINE_EXCEEDED when it "
                                "passes; the generation is cancelled and its KV cache freed); null = none. A gRPC "
                                "client deadline, when shorter, wins.")
    image_dir: str | None = Field(
        None, description="Local directory whose files an OpenAI `image_url` may name (an absolute path, a path "
                          "relative to it, or a file:// URL; symlinks resolved, nothing outside it); null = local "
                          "files refused. data: URLs are always accepted.")
    allow_remote_images: bool = Field(
        False, description="Fetch http(s) `image_url`s (off: they are refused with 400). The server then makes "
                           "requests on a client's behalf, internal addresses included: enable only behind a "
                           "trusted front end. Machines without network just fail those fetches (400).")
    image_fetch_timeout_s: float = Field(
        10.0, gt=0, description="Deadline of one remote image fetch (allow_remote_images).")


class HttpConfig(_Strict):
    """Where the HTTP API listens (`specula serve`): the Ingress replica itself (direct) or Serve's HTTP proxy."""

    host: str = Field("127.0.0.1", description="Bind address of the HTTP API ('0.0.0.0' to serve the network).")
    port: int = Field(8000, ge=0, le=65535, description="Port of the HTTP API.")
    route_prefix: str = Field("/", description="Path prefix of the application: {prefix}v1/chat/completions, "
                                               "{prefix}v1/completions, {prefix}v1/models, {prefix}generate, "
                                               "{prefix}health, {prefix}metrics.")
    served_model_name: str | None = Field(
        None, min_length=1, description="Model id of the OpenAI routes (GET /v1/models, the `model` field of "
                                        "requests; gRPC ListModels); null = the last part of model.path.")
    direct: bool | None = Field(
        None, description="The Ingress replica listens on host:port itself (the same routes, on its own uvicorn "
                          "server) instead of behind Ray Serve's HTTP proxy, whose hop costs about 8 ms per request "
                          "on 2 CPUs; Serve then runs no proxy. Needs one Ingress replica (deployments.ingress: "
                          "num_replicas 1, no autoscaling). null = decided by "
                          "`specula serve`: direct on a local Ray (one machine) with one Ingress replica, behind "
                          "Serve's proxy when joining a cluster (--address) or with more replicas.")

    @field_validator("route_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {v!r}")
        return v


class AuthConfig(_Strict):
    """Optional bearer-token auth on every HTTP route and gRPC method (off while no key is configured)."""

    api_keys: list[str] = Field(
        default_factory=list, description="Accepted tokens (`Authorization: Bearer <token>`, gRPC metadata "
                                          "`authorization: Bearer <token>`). Prefer api_keys_env for secrets.")
    api_keys_env: str | None = Field(
        None, description="Name of an environment variable holding more accepted tokens, comma-separated; read in "
                          "each replica, so secrets stay out of the YAML.")
    open_health: bool = Field(True, description="GET /health and gRPC health checking answer without a token.")

    def keys(self) -> frozenset[str]:
        """Every accepted token (config + environment); empty = auth off."""
        extra = os.environ.get(self.api_keys_env, "") if self.api_keys_env else ""
        return frozenset(k for k in [*self.api_keys, *(x.strip() for x in extra.split(","))] if k)


class GrpcConfig(_Strict):
    """The public gRPC API (protos/specula_api.proto), served by each ingress replica."""

    enabled: bool = Field(True, description="Serve the public gRPC API next to HTTP.")
    host: str = Field("127.0.0.1", description="Bind address ('0.0.0.0' to serve the network).")
    port: int = Field(50051, ge=0, le=65535, description="Port; replicas on one node share it (SO_REUSEPORT). "
                                                         "0 = a free port (tests).")
    max_message_bytes: int = Field(64 * 1024 * 1024, ge=1024,
                                   description="Largest gRPC message accepted or sent (requests carry images).")
    reflection: bool = Field(True, description="Serve gRPC server reflection (so grpcurl works without the proto).")
    tls_cert_file: str | None = Field(None, description="PEM certificate chain: with tls_key_file, serve TLS.")
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file.")

    @model_validator(mode="after")
    def _tls_pair(self) -> GrpcConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        return self


class SpeculaConfig(_Strict):
    """The whole application: model, drafter, data plane, request limits, HTTP, and the four deployments."""

    name: str = Field("specula", min_length=1, description="Serve application name.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The target model.")
    drafter: DrafterConfig = Field(default_factory=DrafterConfig, description="The drafter and how it is used.")
    dataplane: DataplaneConfig = Field(default_factory=DataplaneConfig,
                                       description="Verifier <-> drafter gRPC settings.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request limits at the ingress.")
    http: HttpConfig = Field(default_factory=HttpConfig, description="Where and how the HTTP API listens.")
    grpc: GrpcConfig = Field(default_factory=GrpcConfig, description="The public gRPC API.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Bearer-token auth (HTTP and gRPC).")
    deployments: Deployments = Field(default_factory=Deployments, description="Placement and scaling.")

    @model_validator(mode="before")
    @classmethod
    def _default_drafter(cls, data):
        """A null ``drafter.kind`` becomes the best drafter known for the model (``default_drafter_kind``)."""
        if not isinstance(data, dict):
            return data
        d = data.get("drafter")
        if d is None or (isinstance(d, dict) and d.get("kind") is None):
            d = dict(d or {})
            model = data.get("model")
            path = model.get("path", "target") if isinstance(model, dict) else getattr(model, "path", "target")
            d["kind"] = "ngram" if d.get("options") else default_drafter_kind(path)
            text = BEST_TEXT_DRAFTER
            if d["kind"] == BEST_DRAFTER and "text_only" not in d and text not in (d.get("alternatives") or {}) \
                    and d.get("name") != text and trained_for(text, path):
                d["alternatives"] = {**(d.get("alternatives") or {}), text: {"kind": text}}
                d["text_only"] = text
            data = {**data, "drafter": d}
        return data

    @model_validator(mode="after")
    def _direct_http_has_one_ingress(self) -> SpeculaConfig:
        if self.http.direct and self.deployments.ingress.replicas_at_most() != 1:
            raise ValueError("http.direct: true needs one Ingress replica (deployments.ingress.num_replicas: 1, no "
                             "autoscaling_config): the port is the replica's own; use http.direct: false to serve "
                             "more replicas behind Serve's proxy")
        return self

    @model_validator(mode="after")
    def _drafters_fit_the_model(self) -> SpeculaConfig:
        from specula.runtime.config_records import record_mismatches

        if problems := record_mismatches(self.model.path, self.drafter):
            raise ValueError("; ".join(problems))
        return self


BEST_DRAFTER = "flash"  # the best served drafter for the embedded target (bench served; bench report: all suites)
BEST_TEXT_DRAFTER = "msd"  # the best on its text-only prompts (bench spec --suite text), for drafter.text_only


def default_drafter_kind(model_path) -> str:
    """``BEST_DRAFTER`` when its shipped weights were trained for ``model_path``'s weights (their record's
    ``target_sha256``), else "ngram": a drafter trained for another model would run losslessly but draft badly."""
    return BEST_DRAFTER if trained_for(BEST_DRAFTER, model_path) else "ngram"


def trained_for(shipped: str, model_path) -> bool:
    """Whether the shipped drafter ``shipped`` (a zoo entry) was trained for ``model_path``'s weights."""
    from specula.zoo.store import ZOO_DIR, drafter_record, resolve, weights_fingerprint

    try:
        want = drafter_record(ZOO_DIR / shipped).get("target_sha256")
        return bool(want) and want == weights_fingerprint(resolve(str(model_path)))
    except (OSError, ValueError):  # no such model or weights here: the model's own loader says so later
        return False


def read_config(source: dict | str | os.PathLike) -> dict:
    """The config as a dict, not yet validated: a YAML file's mapping (an empty file is {}), or the dict itself.
    Raises ``ConfigError`` for a missing file, bad YAML or a top level that is not a mapping."""
    where = "config"
    if isinstance(source, (str, os.PathLike)):
        import yaml

        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        where = str(path)
        try:
            source = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not valid YAML: {e}") from None
        if source is None:
            source = {}
    if not isinstance(source, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(source).__name__}")
    return source


def load_config(source: SpeculaConfig | dict | str | os.PathLike, *, where: str | None = None) -> SpeculaConfig:
    """A validated ``SpeculaConfig`` from a YAML file path, a dict, or a config (returned as is).

    Raises ``ConfigError`` naming each bad field by its dotted path, e.g.
    ``deployments.vision_encoder.devise: unknown key`` (after ``where``: the file, by default its path).
    """
    if isinstance(source, SpeculaConfig):
        return source
    where = where or (str(source) if isinstance(source, (str, os.PathLike)) else "config")
    source = read_config(source)
    try:
        return SpeculaConfig.model_validate(source)
    except ValidationError as e:
        raise ConfigError(f"{where}: {_explain(e)}") from None


def _explain(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        path = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "value_error" and "error" in err.get("ctx", {}):
            msg = str(err["ctx"]["error"])  # our own validators' words, without pydantic's "Value error, "
        else:
            msg = err["msg"]
        lines.append(f"{path}: {msg}")
    return "; ".join(lines)


__all__ = [
    "ActorOptions", "AlternativeDrafter", "AuthConfig", "AutoscalingConfig", "ConfigError", "DataplaneConfig",
    "DeploymentSettings", "DeviceDeploymentSettings", "Deployments", "DrafterConfig", "GrpcConfig", "HttpConfig",
    "LimitsConfig", "ModelConfig",
    "SpeculaConfig", "VerifierSettings", "VisionSettings", "load_config",
]
