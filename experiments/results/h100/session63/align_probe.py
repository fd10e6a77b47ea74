# A probe of the simulator's stack alignment (session 63): re-simulates a run's config with the
# profile's sharing section updated by each JSON argument and prints steps/GPU-h, the in-step share
# and stack 1's phase every third step. Run from the repository root.
import json, subprocess, sys, shutil, re
src = sys.argv[1]; run = sys.argv[2]
def probe(**kw):
    d = json.load(open(src)); sh = d["sharing"]
    sh.update(kw)
    json.dump(d, open("/tmp/probe.json", "w"))
    shutil.rmtree("/tmp/simp", ignore_errors=True)
    subprocess.run(["nodus", "sim", f"{run}/config.json", "--profile", "/tmp/probe.json", "--out", "/tmp/simp"], capture_output=True)
    out = subprocess.run(["python", "experiments/stack_alignment.py", "/tmp/simp"], capture_output=True, text=True).stdout
    row = out.splitlines()[2].split("|"); ph = [l for l in out.splitlines() if "stack 1:" in l][0].split(":")[-1].split()
    print(kw, "sph", row[4].strip(), "in-step", row[5].strip(), "phases", " ".join(ph[::3]))
for spec in sys.argv[3:]:
    probe(**json.loads(spec))
