# Run: PYTHONPATH=<checkout>/src python cpu_compile_ab.py on|off (prints one line; the compiled
# block forward forced on or off, otherwise the twelfth session's alternating_ab.py runs)
import pathlib, sys
from mlx_dflash import target
target.COMPILE_BLOCKS = sys.argv[1] == "on"
sys.argv[1] = f"compile-{sys.argv[1]}"
exec((pathlib.Path(__file__).parents[1] / "cpu-session12" / "alternating_ab.py").read_text())
