# One-GPU smoke run of calibrate.Measurer.p2p_under_compute (the exchange is to itself).
# torchrun --nproc-per-node 1 -m lab.probes.p2p_self_smoke   (from the repository root)
import argparse, json
from bench.sp import calibrate
a = argparse.Namespace(emulate_machines=0, no_p2p=True)
m = calibrate.Measurer(a)
m.peer = m.rank
try:
    r = m.p2p_under_compute(64 * calibrate.MIB)
    print("RESULT", json.dumps(r))
finally:
    m.dist.destroy_process_group()
