"""GPU check of the BMM scales backport (vLLM's "Recompute FlashInfer BMM scales when a weight
reload changes the KV scales") on a real FlashInfer FP8-KV decode path.

Run on a machine with an NVIDIA GPU, vLLM (0.32 or 0.33) with CUDA and flashinfer; no
network and no model download are needed (the attention layer is built directly):

    cd <repository root>
    PYTHONPATH=worker_image python tests/gpu/check_flashinfer_fp8_reload.py

It builds one real vLLM ``Attention`` layer (FlashInfer backend, fp8_e4m3 KV cache, FP8
kv-cache scales loaded through vLLM's own Fp8KVCacheMethod), fills a paged FP8 KV cache,
and decodes through ``FlashInferImpl.forward`` and the real FlashInfer kernel, comparing
the output with a float32 reference computed from the same cache and the layer's
current scales. A "reload" loads new k/v scales (1.0 -> 0.5 / 0.25) the way layerwise
reload does. Checks, each printed as PASS / FAIL / SKIP / INFO:

  eager-reload          backported forward after the reload matches the new-scale reference
  eager-unpatched       vLLM's own forward stays on the old scales (shows the check bites)
  graph-reload          a CUDA graph captured BEFORE the reload, replayed after it, matches
                        the new-scale reference (trtllm-gen decode, SM100 family)
  graph-device-scales   during capture the kernel got device tensors, not host floats
  graph-unpatched       the same graph with vLLM's own forward replays stale scales
  xqa-graph-reported    on XQA GPUs (SM90/SM12x; H100/H200) full-graph replay keeps
                        capture-time scales (the fix: not covered); the check passes when
                        refit_worker's unsafe_reasons reports exactly that configuration

Exit status: 0 when nothing FAILED, 1 when a check FAILED, 2 when the environment cannot
run the check (no CUDA, no flashinfer, unsupported GPU) — with the reason printed.
It is not a pytest module (the name does not start with test_); CI never runs it.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 8, 2, 128, 16
SEQ_LENS = (40, 17, 33, 48)
SCALE = HEAD_SIZE**-0.5
OLD, NEW = (1.0, 1.0, 1.0), (1.0, 0.5, 0.25)  # (q, k, v) scales before / after the reload


@dataclass
class Report:
    lines: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, name: str, verdict: str, detail: str) -> None:
        self.lines.append((name, verdict, detail))
        print(f"[{verdict:4}] {name}: {detail}", flush=True)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.add(name, "PASS" if ok else "FAIL", detail)

    @property
    def failed(self) -> bool:
        return any(verdict == "FAIL" for _, verdict, _ in self.lines)


def environment_problem() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device visible (torch.cuda.is_available() is False)"
    for package in ("flashinfer", "vllm", "refit_worker"):
        if importlib.util.find_spec(package) is None:
            hint = " (run with PYTHONPATH=worker_image)" if package == "refit_worker" else ""
            return f"python package {package!r} is not importable{hint}"
    return None


class Harness:
    """One FlashInfer attention layer, its paged FP8 KV cache, and decode metadata."""

    def __init__(self, kernel_kind: str) -> None:
        import torch
        from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config
        from vllm.v1.attention.backends import flashinfer as fi
        from vllm.v1.kv_cache_layout import KVCacheLayout

        self.torch, self.fi = torch, fi
        with set_current_vllm_config(VllmConfig()):
            layer = Attention(
                num_heads=HEADS,
                head_size=HEAD_SIZE,
                scale=SCALE,
                num_kv_heads=KV_HEADS,
                cache_config=CacheConfig(cache_dtype="fp8_e4m3"),
                quant_config=Fp8Config(activation_scheme="static"),
                prefix=f"refit.gpu_check.{id(self)}.attn",
                attn_backend=fi.FlashInferBackend,
            )
        self.layer: Any = layer.to("cuda")
        assert isinstance(self.layer.impl, fi.FlashInferImpl)
        device = torch.device("cuda")
        gen = torch.Generator(device="cuda").manual_seed(0)
        pages = [-(-n // BLOCK) for n in SEQ_LENS]
        num_blocks = sum(pages) + 1
        self.batch = len(SEQ_LENS)
        # vLLM's per-layer cache view: [blocks, kv_heads, block, K|V] ("HND").
        values = torch.randn(
            num_blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE, device=device, generator=gen
        )
        self.kv_fp8 = values.to(torch.float8_e4m3fn)
        self.kv_cache = self.kv_fp8.view(torch.uint8)  # vLLM stores FP8 KV as bytes
        table = torch.zeros(self.batch, max(pages), dtype=torch.int32)
        next_block = 1
        for b, n in enumerate(pages):
            table[b, :n] = torch.arange(next_block, next_block + n)
            next_block += n
        self.block_table = table.to(device)
        self.seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
        self.kernel = (
            fi.FlashInferDecodeKernel.TRTLLM_GEN
            if kernel_kind == "trtllm-gen"
            else fi.FlashInferDecodeKernel.XQA
        )
        # trtllm-gen takes an FP8 query (q scale 1.0); XQA on SM90 a BF16 one.
        self.q_dtype = fi.FP8_DTYPE if kernel_kind == "trtllm-gen" else torch.bfloat16
        query = torch.randn(self.batch, HEADS, HEAD_SIZE, device=device, generator=gen)
        self.query = query.to(self.q_dtype)
        self.output = torch.zeros(self.batch, HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=device)
        self.metadata = fi.FlashInferMetadata(
            kv_cache_layout=KVCacheLayout.LBHNC,
            num_actual_tokens=self.batch,
            slot_mapping=torch.arange(self.batch, device=device),
            q_data_type_prefill=self.q_dtype,
            q_data_type_decode=self.q_dtype,
            num_decodes=self.batch,
            num_decode_tokens=self.batch,
            num_prefills=0,
            num_prefill_tokens=0,
            causal=True,
            prefill=None,
            decode=fi.FlashInferTrtllmAPIDecode(
                kernel=self.kernel,
                block_tables=self.block_table,
                seq_lens=self.seq_lens,
                max_seq_len=max(SEQ_LENS),
            ),
        )

    def load_scales(self, q: float, k: float, v: float) -> None:
        """A (re)load of this layer's FP8 scales through vLLM's own post-load code."""
        layer = self.layer
        if not hasattr(layer, "k_scale"):  # consumed by the last load; reload restores it
            layer.quant_method.create_weights(layer)
            layer.to("cuda")
        for name, value in (("q_scale", q), ("k_scale", k), ("v_scale", v)):
            param = getattr(layer, name)
            param.weight_loader(param, self.torch.tensor(value))
        layer.quant_method.process_weights_after_loading(layer)
        layer.process_weights_after_loading(self.torch.bfloat16)

    def forward(self, forward: Callable[..., Any] | None = None) -> None:
        run = forward.__get__(self.layer.impl) if forward else self.layer.impl.forward
        run(self.layer, self.query, None, None, self.kv_cache, self.metadata, self.output)

    def reference(self, k_scale: float, v_scale: float) -> Any:
        torch = self.torch
        out = torch.zeros(self.batch, HEADS, HEAD_SIZE, device="cuda")
        group = HEADS // KV_HEADS
        for b, n in enumerate(SEQ_LENS):
            blocks = self.block_table[b, : -(-n // BLOCK)].long()
            cache = self.kv_fp8[blocks].float()  # [pages, kvh, block, 2D]
            cache = cache.permute(1, 0, 2, 3).reshape(KV_HEADS, -1, 2 * HEAD_SIZE)[:, :n]
            keys = cache[..., :HEAD_SIZE].repeat_interleave(group, 0) * k_scale
            vals = cache[..., HEAD_SIZE:].repeat_interleave(group, 0) * v_scale
            q = self.query[b].float()  # [H, D]; q scale is 1.0
            probs = torch.softmax(torch.einsum("hd,hnd->hn", q, keys) * SCALE, dim=-1)
            out[b] = torch.einsum("hn,hnd->hd", probs, vals)
        return out

    def error(self, k_scale: float, v_scale: float) -> float:
        ref = self.reference(k_scale, v_scale)
        return float((self.output.float() - ref).abs().max() / ref.abs().max())


TOLERANCE = 0.1  # max abs error relative to max |reference|: FP8 q/P; stale scales give >1


class KernelSpy:
    """Passes every call through to the real kernel, remembering the scales it got."""

    def __init__(self, fi: Any, name: str) -> None:
        self.fi, self.name = fi, name
        self.real = getattr(fi, name)
        self.seen: list[tuple[Any, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.seen.append((kwargs.get("bmm1_scale"), kwargs.get("bmm2_scale")))
        return self.real(*args, **kwargs)

    def __enter__(self) -> KernelSpy:
        setattr(self.fi, self.name, self)
        return self

    def __exit__(self, *exc: object) -> None:
        setattr(self.fi, self.name, self.real)


def describe(scale: Any) -> str:
    import torch

    if isinstance(scale, torch.Tensor):
        return f"device tensor (now {scale.item():.6g})"
    return f"host float {scale:.6g}"


def capture(h: Harness, forward: Callable[..., Any] | None) -> Any:
    torch = h.torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        h.forward(forward)  # warm-up outside capture, as vLLM does before capturing
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h.forward(forward)
    return graph


def run_checks(report: Report) -> None:
    import torch
    import vllm.utils.flashinfer as vllm_fi

    # Never ask NVIDIA's artifactory over the network: trtllm kernels count as available
    # exactly when the flashinfer-cubin package ships them.
    vllm_fi.has_nvidia_artifactory = vllm_fi.has_flashinfer_cubin
    from refit_worker import backports
    from refit_worker.backports import unsafe
    from refit_worker.backports._patch import original_method

    backports.apply_all()
    from vllm.v1.attention.backends import flashinfer as fi

    status = backports.status()
    for name, outcome in status.items():
        report.add(f"capability {name}", "INFO", f"{outcome.state.value}: {outcome.detail}")

    major, minor = torch.cuda.get_device_capability()
    sm = major * 10 + minor
    name = torch.cuda.get_device_name()
    if major == 10:
        kind, spy_name = "trtllm-gen", "trtllm_batch_decode_with_kv_cache"
    elif sm == 90 or major == 12:
        kind, spy_name = "xqa", "flashinfer_xqa_batch_decode_with_kv_cache"
    else:
        report.add("gpu", "SKIP", f"{name} (SM{sm}) has neither trtllm-gen nor XQA decode")
        return
    if not vllm_fi.supports_trtllm_attention():
        report.add("gpu", "SKIP", "FlashInfer trtllm/XQA kernels unavailable (no flashinfer-cubin)")
        return
    report.add("gpu", "INFO", f"{name} (SM{sm}), decode kernel {kind}")
    unpatched = original_method(fi.FlashInferImpl, "forward")

    # --- eager -------------------------------------------------------------------------
    h = Harness(kind)
    h.load_scales(*OLD)
    with KernelSpy(fi, spy_name) as spy:
        h.forward()
        before = h.error(*OLD[1:])
        h.load_scales(*NEW)
        h.forward()
        torch.cuda.synchronize()
        after = h.error(*NEW[1:])
    report.check(
        "eager-before-reload",
        before <= TOLERANCE,
        f"rel. error vs reference(k=1, v=1) {before:.4f}; kernel got bmm1 "
        f"{describe(spy.seen[0][0])}, bmm2 {describe(spy.seen[0][1])}",
    )
    report.check(
        "eager-reload",
        after <= TOLERANCE,
        f"rel. error vs reference(k={NEW[1]}, v={NEW[2]}) {after:.4f}; kernel got bmm1 "
        f"{describe(spy.seen[-1][0])}, bmm2 {describe(spy.seen[-1][1])}",
    )

    h = Harness(kind)
    h.load_scales(*OLD)
    h.forward(unpatched)
    h.load_scales(*NEW)
    h.forward(unpatched)
    torch.cuda.synchronize()
    stale, fresh = h.error(*OLD[1:]), h.error(*NEW[1:])
    report.add(
        "eager-unpatched",
        "INFO",
        f"vLLM's own forward after the reload: rel. error vs new scales {fresh:.4f}, vs old "
        f"scales {stale:.4f} ({'stale: the BMM scales bug present' if stale < fresh else 'fresh'})",
    )

    # --- CUDA graph captured before the reload -------------------------------------------
    h = Harness(kind)
    h.load_scales(*OLD)
    with KernelSpy(fi, spy_name) as spy:
        graph = capture(h, None)
        captured = spy.seen[-1]
    h.load_scales(*NEW)  # updates the scale buffers in place, as a reload does
    h.output.zero_()
    graph.replay()
    torch.cuda.synchronize()
    replay_new, replay_old = h.error(*NEW[1:]), h.error(*OLD[1:])
    got = f"bmm1 {describe(captured[0])}, bmm2 {describe(captured[1])}"
    if kind == "trtllm-gen":
        report.check(
            "graph-device-scales",
            all(isinstance(s, torch.Tensor) for s in captured),
            f"during capture the kernel got {got}",
        )
        report.check(
            "graph-reload",
            replay_new <= TOLERANCE,
            f"replay after the reload: rel. error vs new scales {replay_new:.4f} "
            f"(vs old {replay_old:.4f})",
        )
        g2 = Harness(kind)
        g2.load_scales(*OLD)
        graph2 = capture(g2, unpatched)
        g2.load_scales(*NEW)
        graph2.replay()
        torch.cuda.synchronize()
        report.add(
            "graph-unpatched",
            "INFO",
            f"vLLM's own forward, replay after the reload: rel. error vs new scales "
            f"{g2.error(*NEW[1:]):.4f}, vs old {g2.error(*OLD[1:]):.4f}",
        )
    else:
        cfg = unsafe.GraphConfig(
            attention_backends=("FLASHINFER",),
            kv_cache_dtype="fp8_e4m3",
            cudagraph_mode="FULL_AND_PIECEWISE",
            device_capability=sm,
            trtllm_decode=bool(h.layer.impl.supports_xqa_or_trtllm_gen_decode),
        )
        reasons = unsafe.reasons_for(cfg)
        report.add(
            "xqa-graph-replay",
            "INFO",
            f"captured with {got}; replay after the reload: rel. error vs new scales "
            f"{replay_new:.4f}, vs old {replay_old:.4f} "
            f"({'stale, as the fix documents' if replay_old < replay_new else 'followed'})",
        )
        report.check(
            "xqa-graph-reported",
            any("XQA" in r for r in reasons),
            f"unsafe_reasons for this config: {reasons or 'none'}",
        )
    report.add(
        "graph-mode-note",
        "INFO",
        "piecewise/eager graphs re-run forward in Python, so they follow eager-reload",
    )


def main() -> int:
    problem = environment_problem()
    if problem:
        print(f"[SKIP] environment: {problem}; nothing checked")
        print("VERDICT: NOT RUN")
        return 2
    report = Report()
    try:
        run_checks(report)
    except Exception as exc:
        traceback.print_exc()
        report.add("harness", "FAIL", f"{type(exc).__name__}: {exc}")
    verdict = "FAIL" if report.failed else "PASS"
    if not report.failed and not any(v == "PASS" for _, v, _ in report.lines):
        verdict = "NOT RUN"
    print(f"VERDICT: {verdict}")
    return {"PASS": 0, "FAIL": 1}.get(verdict, 2)


if __name__ == "__main__":
    sys.exit(main())
