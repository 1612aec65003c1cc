"""Device profiles: every shipped file validates; bad files fail naming file and field."""

from __future__ import annotations

import pytest

from edgeflow.errors import ProfileError
from edgeflow.profiles import (
    HostFacts,
    builtin_profiles,
    detect,
    get_profile,
    load_profile_file,
    profile_from_dict,
)

REQUIRED_BOARDS = {
    "raspberry-pi-zero-2w", "raspberry-pi-4", "raspberry-pi-5", "jetson-orin-nano",
    "coral-dev-board", "beaglebone-black", "visionfive-2", "x86-gateway",
}


def _base(**over):
    d = {
        "name": "b", "description": "d", "arch": "aarch64", "cores": 4, "memory_mb": 1024,
        "memory_budget_mb": 256, "threads": 4, "backends": ["ort", "numpy"],
    }
    d.update(over)
    return d


def test_builtin_profiles_cover_the_boards_and_validate():
    profs = builtin_profiles()
    assert REQUIRED_BOARDS <= set(profs)
    for p in profs.values():
        assert p.threads <= p.cores
        assert p.memory_budget_mb <= p.memory_mb


def test_boards_without_onnxruntime_wheels_use_numpy_only():
    for name in ("raspberry-pi-zero-2w", "beaglebone-black", "visionfive-2"):
        assert get_profile(name).backends == ("numpy",)


def test_gpu_board_prefers_tensorrt_then_cuda_with_fp16():
    p = get_profile("jetson-orin-nano")
    assert p.execution_providers[:2] == ("TensorrtExecutionProvider", "CUDAExecutionProvider")
    assert p.quantization.scheme == "fp16"


def test_x86_uses_uint8_activations():
    assert get_profile("x86-gateway").quantization.activations == "uint8"


@pytest.mark.parametrize(
    "over, field",
    [
        ({"colour": "red"}, "colour"),
        ({"arch": "sparc"}, "arch"),
        ({"cores": 0}, "cores"),
        ({"cores": True}, "cores"),
        ({"threads": 8}, "threads"),
        ({"backends": ["tpu"]}, "backends"),
        ({"backends": []}, "backends"),
        ({"memory_budget_mb": 4096}, "memory_budget_mb"),
        ({"quantization": {"scheme": "int4"}}, "quantization.scheme"),
        ({"quantization": {"bits": 8}}, "quantization.bits"),
        ({"quantization": {"activations": "int16"}}, "quantization.activations"),
        ({"arch": "x86_64", "quantization": {"format": "qoperator", "activations": "int8"}}, "quantization.activations"),
    ],
)
def test_bad_field_is_named(over, field):
    with pytest.raises(ProfileError, match=rf"myboard.toml: field '{field}'"):
        profile_from_dict(_base(**over), "myboard.toml")


def test_missing_required_field_is_named():
    d = _base()
    del d["threads"]
    with pytest.raises(ProfileError, match="field 'threads': required"):
        profile_from_dict(d, "x.toml")


def test_file_errors(tmp_path):
    with pytest.raises(ProfileError, match="not found"):
        load_profile_file(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed")
    with pytest.raises(ProfileError, match="bad.toml: not valid TOML"):
        load_profile_file(bad)
    wrong = tmp_path / "other.toml"
    wrong.write_text('name = "b"\ndescription = "d"\narch = "aarch64"\ncores = 1\nmemory_mb = 64\n'
                     'memory_budget_mb = 32\nthreads = 1\nbackends = ["numpy"]\n')
    with pytest.raises(ProfileError, match="must match the file name"):
        load_profile_file(wrong)


def test_custom_profile_by_path(tmp_path):
    f = tmp_path / "myboard.toml"
    f.write_text('name = "myboard"\ndescription = "d"\narch = "arm64"\ncores = 2\nmemory_mb = 512\n'
                 'memory_budget_mb = 100\nthreads = 2\nbackends = ["numpy"]\n')
    p = get_profile(str(f))
    assert p.arch == "aarch64"  # alias normalised
    assert p.quantization.scheme == "int8"


def test_unknown_profile_lists_known():
    with pytest.raises(ProfileError, match="raspberry-pi-4"):
        get_profile("raspberry-pi-9")


@pytest.mark.parametrize(
    "facts, expected",
    [
        (HostFacts("aarch64", 4, 3900, ("asimd", "neon"), "Raspberry Pi 4 Model B Rev 1.4"), "raspberry-pi-4"),
        (HostFacts("aarch64", 4, 8000, ("asimd",), "Raspberry Pi 5 Model B Rev 1.0"), "raspberry-pi-5"),
        (HostFacts("armv7l", 4, 430, ("neon", "vfpv4"), "Raspberry Pi Zero 2 W Rev 1.0"), "raspberry-pi-zero-2w"),
        (HostFacts("armv7l", 1, 480, ("neon", "vfpv3"), ""), "beaglebone-black"),
        (HostFacts("riscv64", 4, 4000, (), ""), "visionfive-2"),
        (HostFacts("x86_64", 2, 24000, ("avx2", "avx512f", "avx512_vnni"), ""), "x86-gateway"),
    ],
)
def test_detect_picks_closest(facts, expected):
    assert detect(facts).name == expected


def test_detect_unknown_arch_is_clear():
    with pytest.raises(ProfileError, match="no built-in profile for architecture 'mips'"):
        detect(HostFacts("mips", 1, 64, (), ""))


def test_detect_this_host_returns_a_profile():
    assert detect().name in builtin_profiles()


def test_host_differs_names_what_makes_this_hosts_timings_not_the_boards():
    from edgeflow.profiles import host_differs

    vnni = get_profile("x86-gateway")
    assert host_differs(vnni, HostFacts("x86_64", 2, 8000, ("avx2", "avx512f", "avx512_vnni", "fma"), "")) is None
    msg = host_differs(vnni, HostFacts("x86_64", 2, 8000, ("avx2", "fma"), ""))
    assert msg == "this host lacks avx512f, avx512_vnni, which the profile 'x86-gateway' names"
    pi = get_profile("raspberry-pi-4")
    assert host_differs(pi, HostFacts("x86_64", 2, 8000, ("avx2",), "")) == (
        "this host is x86_64, the profile 'raspberry-pi-4' is aarch64")
    assert host_differs(pi, HostFacts("aarch64", 4, 3900, ("asimd", "neon"), "")) is None
    assert host_differs(pi, HostFacts("aarch64", 4, 3900, (), "")) is None  # flags unknown: no claim


def test_a_host_without_vnni_saturates_where_a_vnni_board_does_not():
    from edgeflow.profiles import saturates_where_board_does_not as saturates

    vnni = get_profile("x86-gateway")
    assert saturates(vnni, HostFacts("x86_64", 2, 8000, ("avx2", "fma"), ""))
    assert not saturates(vnni, HostFacts("x86_64", 2, 8000, ("avx2", "avx_vnni"), ""))
    assert not saturates(vnni, HostFacts("x86_64", 2, 8000, (), ""))  # flags unknown: no claim
    assert not saturates(get_profile("raspberry-pi-4"), HostFacts("x86_64", 2, 8000, ("avx2",), ""))
