"""The engines measured beside specdec's own loop: an OpenAI-compatible server over HTTP
(endpoint.py; stream.py, the one reader of streamed responses, which the load-test scripts and
the server tests read through too), stock llama.cpp's server and lookup tool, the "same kernels"
twin and ik_llama.cpp (anchor_build.py builds them, anchors.py starts them; peers.py: their
modes and flags; ik_source.py: ik_llama.cpp from an upstream tree), transformers' assisted
generation (hf_assisted.py). Imports the study's artifacts/ at most."""
