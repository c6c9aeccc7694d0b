"""The step profile's arithmetic and its setting: the all-reduces of several ranks split into
the transfer (the shortest of each call) and each rank's wait, and a malformed setting refused
by name."""

from __future__ import annotations

import pytest

from pensieve.actors.executor.kernel_profile import (
    PROFILE_ENV,
    StepProfile,
    all_reduce_wait,
    kernel_kind,
)


def test_all_reduces_split_into_transfer_and_each_ranks_wait() -> None:
    # the first all-reduce: rank 0 waited 20 us for rank 1; the second: rank 1 waited 5 us;
    # rank 0's third has no peer in the window and is left out
    split = all_reduce_wait([[30.0, 10.0, 99.0], [10.0, 15.0]])
    assert split["calls"] == 2
    assert split["transfer_s"] == pytest.approx(20e-6)
    assert split["total_s"] == pytest.approx([40e-6, 25e-6])
    assert split["wait_s"] == pytest.approx([20e-6, 5e-6])
    assert all_reduce_wait([[], [1.0]]) == {"calls": 0}


def test_kernels_are_named_by_what_they_do() -> None:
    assert kernel_kind("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "all-reduce"
    assert kernel_kind("c10d::allreduce_") == "all-reduce"
    assert kernel_kind("nvjet_hsh_128x256_64x4_2x1_v_bz_coopB_TNT") == "matmul"
    assert kernel_kind("_paged_attention_kernel") == "attention"
    assert kernel_kind("elementwise_kernel") == "other"


def test_the_setting_names_a_folder_and_two_step_numbers(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    assert StepProfile.from_env(0, cuda=False) is None
    monkeypatch.setenv(PROFILE_ENV, f"{tmp_path},100,20")
    profile = StepProfile.from_env(1, cuda=False)
    assert profile is not None and profile.path == tmp_path / "rank1.json"
    assert profile.wants(100) and profile.wants(119) and not profile.wants(120)
    monkeypatch.setenv(PROFILE_ENV, f"{tmp_path},100")
    with pytest.raises(ValueError, match=f"{PROFILE_ENV} is DIR,FIRST,COUNT"):
        StepProfile.from_env(0, cuda=False)
