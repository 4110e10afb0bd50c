"""The PyTorch reference side of the tests ("oracle"): regenerates tests/data/ with diffusers',
transformers' and torch's own code, in its own venv (`make oracle`, `python -m tests.oracle`).

Nothing here is imported by `make test`: the project's tests read only the files it writes.
"""
