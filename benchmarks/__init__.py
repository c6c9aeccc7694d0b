"""GPU benchmarks, the policy simulator, GPU-machine scripts; not installed, run from repo root."""
