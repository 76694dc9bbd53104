"""What a verification step's matrix products cost on a GPU: the linear layers and the LM head of a
7B decoder for ``n`` tokens in one forward pass.

``python -m benchmarks.gpu_gemm [--tokens 16,64,...] [--repeats 15] [--json PATH]`` (needs CUDA)

The shapes are DeepSeek-R1-Distill-Qwen-7B's (Qwen2-7B: hidden 3584, MLP 18944, 28 layers, 4 KV
heads of 128, vocabulary 152,064; bf16, random weights): per layer the QKV, output, gate/up and
down projections, then the LM head (a verification step needs logits at every verified token).
Attention, norms, sampling and launches are left out, so this is the part of a step that grows
with the tokens verified: its time is flat while the weights' memory traffic bounds it and then
grows by ``2 * params / achieved FLOP/s`` per token. That slope is what a draft token costs where
verification is compute-bound, the ``c_tok`` of the cost line ``t = c_base + c_tok * tokens``
(``benchmarks.step_cost --prices``, the simulator's ``h100_7b_roofline``). Each count's time is
the median of ``--repeats`` CUDA-synchronised passes after 3 warm-ups.

JSON: ``{"gpu", "params", "flops_per_token", "tokens": {"256": {"ms", "tflops"}, ...}}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

HIDDEN, MLP, LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 3584, 18944, 28, 4, 128, 152064
DEFAULT_TOKENS = (16, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def measure(tokens, repeats: int) -> dict:
    """Median seconds of one pass per token count (CUDA), as a report dict."""
    import torch

    dev, bf16 = "cuda", torch.bfloat16
    torch.manual_seed(0)
    layers = [(torch.randn(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN, device=dev, dtype=bf16) * 0.01,
               torch.randn(HIDDEN, HIDDEN, device=dev, dtype=bf16) * 0.01,
               torch.randn(2 * MLP, HIDDEN, device=dev, dtype=bf16) * 0.01,
               torch.randn(HIDDEN, MLP, device=dev, dtype=bf16) * 0.01) for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN, device=dev, dtype=bf16) * 0.01
    params = sum(w.numel() for layer in layers for w in layer) + head.numel()

    def forward(x):
        for qkv, out, gate_up, down in layers:
            x = (x @ qkv.T)[:, :HIDDEN] @ out.T
            g = x @ gate_up.T
            x = (torch.nn.functional.silu(g[:, :MLP]) * g[:, MLP:]) @ down.T
        return x @ head.T

    report = {"gpu": torch.cuda.get_device_name(0), "params": params, "flops_per_token": 2 * params, "tokens": {}}
    for n in tokens:
        x = torch.randn(n, HIDDEN, device=dev, dtype=bf16)
        for _ in range(3):
            forward(x)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            forward(x)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = sorted(times)[len(times) // 2]
        report["tokens"][str(n)] = {"ms": round(t * 1e3, 3), "tflops": round(2 * params * n / t / 1e12, 1)}
        print(f"{n:6d} tokens: {t * 1e3:8.3f} ms  {2 * params * n / t / 1e12:6.1f} TFLOP/s", flush=True)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="tokens per pass (comma-separated)")
    p.add_argument("--repeats", type=int, default=15, help="timed passes per token count (median)")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    try:
        tokens = [int(x) for x in args.tokens.split(",") if x.strip()]
    except ValueError:
        tokens = []
    if not tokens or min(tokens) < 1 or args.repeats < 1:
        print(f"--tokens must be integers >= 1 and --repeats >= 1, got {args.tokens!r} and {args.repeats}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("benchmarks.gpu_gemm needs a CUDA GPU (torch.cuda.is_available() is False here)", file=sys.stderr)
        return 2
    report = measure(tokens, args.repeats)
    if args.json:
        from integrations.results import write_atomic

        print(f"wrote {write_atomic(args.json, json.dumps(report, indent=1))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
