"""`python -m minivllm.kernels`: build every C++ kernel for this CPU (make install runs it) and say which built."""

import sys

from minivllm.kernels.build import build_all

sys.exit(0 if build_all() else 1)
