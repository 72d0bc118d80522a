"""``hidden-states`` with ``--cuda-graphs``' copies left out, for tests/e2e/test_graph_capture.py's
negative proof:

    python graph_negative_driver.py ARGS...

The workers run the eager own capture (``own_capture``: hooks put on the decoder layers once the
engine has started) instead of ``graph_capture``'s copies, and vLLM is started compiled as
``--cuda-graphs`` starts it. The hooks come after vLLM compiled its forward: none of them runs.
"""
import sys

from hidden_states.backends import vllm_engine
from hidden_states.cli import main

if __name__ == "__main__":
    vllm_engine.GRAPH_EXTENSION = vllm_engine.EXTENSIONS[vllm_engine.OWN]
    sys.exit(main(sys.argv[1:]))
