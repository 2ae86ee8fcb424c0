# Run: PYTHONPATH=<checkout>/src python alternating_ab_variants.py default|queued-padded|queued-exact
import sys
from mlx_dflash import engine, rollback
variant = sys.argv[1]
if variant.startswith("queued"):
    engine.on_gpu = lambda: True  # queue blocks ahead as on a GPU (this script only)
    rollback.PAD_READS = variant == "queued-padded"
exec(open(__import__("pathlib").Path(__file__).with_name("alternating_ab.py")).read())  # the same runs
