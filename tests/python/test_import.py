import ditscale
import ditscale._core as core


def test_version_and_core_module():
    assert ditscale.__version__
    assert core.Error is not None
