import os

import pytest

from fastdp import _backend
from fastdp.testing import BACKENDS, set_backend


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run the test once with the C++ extension allowed and once on the pure-torch path."""
    prev = set_backend(request.param)
    yield request.param
    _backend.set_enabled(prev)


def pytest_report_header(config):
    from fastdp._info import info

    d = info()
    return (f"fastdp {d['version']}: torch {d['torch']}, extension loaded={d['extension_loaded']}, "
            f"built_with_cuda={d['built_with_cuda']}, gpus={len(d['gpus'])}, "
            f"FASTDP_DISABLE_EXT={os.environ.get('FASTDP_DISABLE_EXT', '0')}")
