"""Check mega.obs's GPU timing path on a CUDA machine (it cannot run on the CPU-only test machines).

    PYTHONPATH=. python scripts/gpu/obs_cuda_events.py        # prints a JSON verdict, exit 1 if a check fails

What it checks, with real torch.cuda.Events on one GPU:

* spans around asynchronously launched GPU work get device times: the device duration of a span
  of matmuls is close to the same work timed with a synchronize, while its host duration (the
  launch) is much shorter;
* the recorder never synchronises in the loop: ``torch.cuda.synchronize`` is called once, when the
  DeviceTimer is created, and not by ``begin_step`` / ``end_step``;
* a step whose events are still pending falls back to host times without waiting.

Not checked here: NCCL collectives and the PP exchange on device tensors (need 2+ GPUs and a
training job: run ``python -m mega.bench observability cluster=gpu-1 ...`` on a multi-GPU node).
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    import torch

    from mega.obs.cuda import DeviceTimer
    from mega.obs.recorder import Recorder

    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 1
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):  # warm-up: the first products pay cuBLAS's start-up, not the GEMM
        a @ a
    torch.cuda.synchronize()

    # the reference: the same work timed with synchronize
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    reference_s = time.perf_counter() - t0

    syncs = []
    original = torch.cuda.synchronize
    timer = DeviceTimer(time.perf_counter_ns)  # its one synchronize, before the loop

    def counting(*args, **kwargs):
        syncs.append(1)
        return original(*args, **kwargs)

    torch.cuda.synchronize = counting
    try:
        rec = Recorder(None, {"rank": 0}, device_timer=timer)
        results = []
        for step in range(3):
            rec.begin_step(step)
            with rec.span("forward", "forward"):
                for _ in range(20):
                    a @ a
            pending = rec.end_step()  # the GPU is still busy: host times, no wait
            pending_device = rec.summary["device_times"]
            torch.cuda.current_stream().synchronize()  # the test (not the recorder) lets the GPU finish
            rec.begin_step(step + 10)
            with rec.span("backward", "backward"):
                for _ in range(20):
                    a @ a
            b = torch.ones(1, device="cuda")
            b.item()  # what megatron's loss .item() does every step: the host catches up
            rec.end_step()
            device = rec.device
            host = rec.spans[0]
            results.append(
                {
                    "pending_step_used_device_times": pending_device,
                    "pending_compute_s": pending["compute_s"],
                    "device_times": rec.summary["device_times"],
                    "device_span_s": (device["spans"][0][3] - device["spans"][0][2]) * 1e-9
                    if device
                    else None,
                    "host_span_s": (host[3] - host[2]) * 1e-9,
                }
            )
    finally:
        torch.cuda.synchronize = original
    last = results[-1]
    checks = {
        "device_times_resolved": all(r["device_times"] for r in results),
        "device_close_to_reference": last["device_span_s"] is not None
        and abs(last["device_span_s"] - reference_s) < 0.25 * reference_s,
        "host_is_only_the_launch": last["host_span_s"] < 0.5 * last["device_span_s"],
        "no_synchronize_in_the_loop": not syncs,
    }
    print(
        json.dumps(
            {
                "ok": all(checks.values()),
                "checks": checks,
                "reference_s": reference_s,
                "steps": results,
                "device": torch.cuda.get_device_name(),
            }
        )
    )
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
