"""Version pin check and the multi-rank harness's failure reporting."""
import time

import pytest
import torch

from megarl import platform
from megarl.platform import VersionMismatchError, check_versions
from megarl.testing import RankFailure, run_ranks


@pytest.mark.unit
def test_installed_megatron_core_is_the_pinned_one():
    check_versions()  # the real environment
    assert platform.PINNED["megatron-core"] == "0.19.2"


@pytest.mark.unit
@pytest.mark.parametrize("installed,needle", [
    ({"megatron-core": "0.16.1"}, "megatron-core 0.16.1 is installed, but megarl is tested with megatron-core==0.19.2"),
    ({}, "megatron-core is not installed"),
])
def test_version_mismatch_stops_with_the_fix(installed, needle):
    with pytest.raises(VersionMismatchError) as error:
        check_versions(installed)
    assert needle in str(error.value) and "launchers/install.sh" in str(error.value)


def _setup_as_if_on_gpu():
    from megarl.compat import megatron as cpu_shims

    for name in cpu_shims.applied():
        cpu_shims.revert(name)
    platform._done = False
    torch.cuda.is_available = lambda: True  # this forked rank only
    platform.setup()
    return cpu_shims.applied(), platform.transformer_config_overrides(), platform.distributed_backend()


@pytest.mark.multirank
def test_no_shims_and_no_cpu_flags_on_gpu():
    (result,) = run_ranks(1, _setup_as_if_on_gpu)
    assert result == ([], {}, "nccl")


@pytest.mark.unit
def test_cpu_overrides_only_on_cpu():
    overrides = platform.transformer_config_overrides()
    assert overrides["batch_p2p_comm"] is False and overrides["use_cpu_initialization"] is True
    assert platform.distributed_backend() == "gloo"


def _fail_on_rank_one():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank one broke")
    return dist.get_rank()


def _hang_on_rank_zero():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        time.sleep(60)
    return dist.get_rank()


def _init_and_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


@pytest.mark.multirank
def test_harness_returns_results_in_rank_order():
    assert run_ranks(3, _init_and_rank) == [(0, 3), (1, 3), (2, 3)]


@pytest.mark.multirank
def test_harness_reports_the_failing_rank_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(2, _fail_on_rank_one, timeout=60)
    assert time.monotonic() - start < 30  # rank 0, stuck waiting for rank 1 at teardown, is not waited for long
    assert "rank 1 failed" in str(failure.value) and "ValueError: rank one broke" in str(failure.value)


@pytest.mark.multirank
def test_harness_times_out_with_the_hung_stack():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(2, _hang_on_rank_zero, timeout=2)
    assert time.monotonic() - start < 30
    message = str(failure.value)
    assert "rank 0 did not finish within 2s" in message and "_hang_on_rank_zero" in message


@pytest.mark.unit
def test_version_pin_is_enforced_only_where_the_cpu_shims_apply(monkeypatch):
    from megarl import platform

    def mismatch():
        raise platform.VersionMismatchError("megatron-core 0.20.0 is installed")

    monkeypatch.setattr(platform, "check_versions", mismatch)
    monkeypatch.setattr(platform, "_done", False)
    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    platform.setup()  # GPU: no shim, no pin
    monkeypatch.setattr(platform, "_done", False)
    monkeypatch.setattr(platform, "on_gpu", lambda: False)
    with pytest.raises(platform.VersionMismatchError):
        platform.setup()  # CPU: the shims patch exactly the pinned release
