# Which transfers progress while cuDNN attention (persistent: every SM for the whole call) runs?
import torch
dev = torch.device("cuda", 0)
h, n, d = 24, 66048, 128
q = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16); k = torch.randn_like(q); v = torch.randn_like(q)
src = torch.randn(64 << 20, device=dev)  # 256 MiB
dst = torch.empty_like(src)
host = torch.empty(64 << 20, dtype=torch.float32, pin_memory=True)
hi = torch.cuda.Stream(priority=-3)
def cudnn(): torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)
probes = {
    "SM kernel (mul_)": lambda: dst.mul_(1.0000001),
    "CE copy D2D 256 MiB": lambda: dst.copy_(src, non_blocking=True),
    "CE copy D2H 256 MiB": lambda: host.copy_(src, non_blocking=True),
}
def run(att_first, probe, reps=3):
    res = []
    for _ in range(reps):
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        side = torch.cuda.Stream(priority=0)
        def a():
            with torch.cuda.stream(side):
                ev[0].record(); cudnn(); ev[1].record()
        def p():
            with torch.cuda.stream(hi):
                ev[2].record(); probe(); ev[3].record()
        if att_first is None:
            p()
        elif att_first:
            a(); p()
        else:
            p(); a()
        torch.cuda.synchronize()
        res.append((ev[2].elapsed_time(ev[3]), ev[0].elapsed_time(ev[1]) if att_first is not None else 0.0))
    return sorted(res)[reps // 2]
cudnn(); [f() for f in probes.values()]; torch.cuda.synchronize()
for name, f in probes.items():
    for mode, lab in ((None, "alone"), (True, "launched after attention"), (False, "launched before attention")):
        p, a = run(mode, f)
        print(f"{name:22s} {lab:26s}: probe {p:8.3f} ms  attention {a:7.2f} ms", flush=True)
