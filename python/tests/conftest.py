"""pytest configuration of stepcore's Python suites: the `gpu` marker (tests that need a
CUDA device, a torch with CUDA and a stepcore built with CUDA; they skip, saying which is
missing, elsewhere). `-m gpu` runs only those, `-m "not gpu"` the others."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu: needs a CUDA device, torch with CUDA and stepcore built with CUDA (skips otherwise)",
    )
