"""The pure-fp32 DeepSeek-V4 reference (DESIGN §2)."""

from reference.vector_math import warm_up_vector_math

warm_up_vector_math()  # before any parallel use of MKL's vector math: see reference/vector_math.py
