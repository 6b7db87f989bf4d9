import sys
from pathlib import Path

# the pass tests share helpers with the graph tests (interpreter, LLaMA graph)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "graph"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
