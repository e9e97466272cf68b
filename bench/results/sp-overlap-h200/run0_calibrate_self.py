# One-GPU smoke run of calibrate.Measurer.p2p_under_compute (the exchange is to itself).
import argparse, json, os, sys
sys.path.insert(0, "bench/sp")
import calibrate
a = argparse.Namespace(emulate_machines=0, no_p2p=True)
m = calibrate.Measurer(a)
m.peer = m.rank
try:
    r = m.p2p_under_compute(64 * calibrate.MIB)
    print("RESULT", json.dumps(r))
finally:
    m.dist.destroy_process_group()
