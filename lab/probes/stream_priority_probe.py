# Does a kernel on another stream run while cuDNN attention runs? (one GPU)
import torch, json
torch.manual_seed(0)
dev = torch.device("cuda", 0)
h, n, d = 24, 66048, 128
q = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16); k = torch.randn_like(q); v = torch.randn_like(q)
x = torch.randn(32 << 20, device=dev)  # 128 MiB fp32
lo, hi = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)
def cudnn(): torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)
def flash(): torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)
def small(): x.mul_(1.0000001)
def timed(att, probe_stream, reps=3):
    res = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a0, a1, p0, p1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        side = torch.cuda.Stream(priority=0)
        if att is not None:
            with torch.cuda.stream(side):
                a0.record(); att(); a1.record()
        with torch.cuda.stream(probe_stream):
            p0.record(); small(); p1.record()
        torch.cuda.synchronize()
        res.append((p0.elapsed_time(p1), a0.elapsed_time(a1) if att else 0.0))
    return sorted(res)[reps // 2]
for f in (cudnn, flash, small):
    f()
torch.cuda.synchronize()
out = {}
for name, att in (("none", None), ("cudnn", cudnn), ("flash", flash)):
    for sname, st in (("lo", lo), ("hi", hi)):
        p, a = timed(att, st)
        out[f"{name}/{sname}"] = (round(p, 3), round(a, 2))
        print(f"attention {name:5s} probe stream {sname}: probe kernel {p:8.3f} ms, attention {a:7.2f} ms", flush=True)
# How long until the probe STARTS (event before it on the probe stream measures from launch)
print(json.dumps(out))
print("priority range", torch.cuda.Stream.priority_range())
