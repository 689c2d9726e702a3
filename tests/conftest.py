"""The top-level tests (the examples): markers as the packages register them (this folder has no pyproject)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skips cleanly without one")
    config.addinivalue_line("markers", "multi_gpu: needs two CUDA GPUs (tensors on a device that is not the current "
                                       "one); skips below two")
