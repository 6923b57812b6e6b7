"""The /proc parsers, on sample texts taken from real machines."""

from __future__ import annotations

import pytest

from offload.pure.env.procfs import find_libcudart, is_wsl_release, parse_meminfo, parse_memlock_limit

MEMINFO_X86 = """\
MemTotal:       24683656 kB
MemFree:        23981952 kB
MemAvailable:   24243904 kB
Buffers:            2100 kB
Cached:           512340 kB
HugePages_Total:       0
HugePages_Free:        0
Hugepagesize:       2048 kB
"""

# Kernels before 3.14 have no MemAvailable line.
MEMINFO_OLD_KERNEL = """\
MemTotal:        8054304 kB
MemFree:         1234567 kB
Buffers:          102400 kB
"""

MEMINFO_GH200 = """\
MemTotal:       503270080 kB
MemFree:        470001024 kB
MemAvailable:   489953600 kB
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(MEMINFO_X86, (24683656 * 1024, 24243904 * 1024), id="x86"),
        pytest.param(MEMINFO_GH200, (503270080 * 1024, 489953600 * 1024), id="gh200"),
        pytest.param(MEMINFO_OLD_KERNEL, (8054304 * 1024, None), id="no-memavailable"),
        pytest.param("", (None, None), id="empty"),
        pytest.param("garbage\n\x00\nMemTotal:\nMemAvailable: lots kB\n", (None, None), id="junk"),
        pytest.param("MemTotal: 100 MB\nMemAvailable: 7 kB\n", (None, 7 * 1024), id="unknown-unit"),
        pytest.param("MemTotal: 4096\nMemAvailable: 2048\n", (4096, 2048), id="no-unit-is-bytes"),
        pytest.param("MemTotal: 1 kB\nMemTotal: 2 kB\n", (1024, None), id="first-wins"),
        pytest.param("MemTotal: \u00b2 kB\nMemAvailable: -5 kB\n", (None, None), id="not-ascii-digits"),
        pytest.param("MemAvailableX: 1 kB\nXMemTotal: 2 kB\n", (None, None), id="whole-key-only"),
    ],
)
def test_parse_meminfo(text: str, expected: tuple[int | None, int | None]) -> None:
    assert parse_meminfo(text) == expected


LIMITS_HEADER = "Limit                     Soft Limit           Hard Limit           Units     \n"
LIMITS_CONTAINER = (
    LIMITS_HEADER
    + "Max stack size            8388608              unlimited            bytes     \n"
    + "Max locked memory         8388608              8388608              bytes     \n"
    + "Max address space         unlimited            unlimited            bytes     \n"
)
LIMITS_UNLIMITED = LIMITS_HEADER + "Max locked memory         unlimited            unlimited            bytes     \n"
LIMITS_SOFT_BELOW_HARD = LIMITS_HEADER + "Max locked memory         65536                unlimited            bytes     \n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(LIMITS_CONTAINER, 8 * 1024 * 1024, id="container-8MiB"),
        pytest.param(LIMITS_UNLIMITED, None, id="unlimited"),
        pytest.param(LIMITS_SOFT_BELOW_HARD, 65536, id="soft-limit-is-read"),
        pytest.param("Max locked memory 0 0 bytes\n", 0, id="zero"),
    ],
)
def test_parse_memlock_limit(text: str, expected: int | None) -> None:
    assert parse_memlock_limit(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("", "no 'Max locked memory' line", id="empty"),
        pytest.param(LIMITS_HEADER + "Max stack size 8388608 unlimited bytes\n", "no 'Max locked memory'", id="absent"),
        pytest.param("Max locked memory         lots   lots  bytes\n", "unreadable", id="junk-value"),
        pytest.param("Max locked memory\n", "unreadable", id="no-value"),
        pytest.param("Max locked memory   \u00b2  \u00b2  bytes\n", "unreadable", id="not-ascii-digits"),
    ],
)
def test_parse_memlock_limit_rejects_text_without_a_limit(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_memlock_limit(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("5.15.167.4-microsoft-standard-WSL2\n", True, id="wsl2-osrelease"),
        pytest.param("4.4.0-19041-Microsoft\n", True, id="wsl1-osrelease"),
        pytest.param(
            "Linux version 5.15.90.1-microsoft-standard-WSL2 (oe-user@oe-host) (x86_64-msft-linux-gcc (GCC) 12.2.0)",
            True,
            id="wsl2-version",
        ),
        pytest.param("6.1.0-wsl-custom\n", True, id="wsl-any-case"),
        pytest.param("6.18.44-fc-v782\n", False, id="plain-linux"),
        pytest.param("5.14.0-427.el9.x86_64\n", False, id="rhel"),
        pytest.param("6.8.0-1015-nvidia-64k\n", False, id="gh200-ubuntu"),
        pytest.param("", False, id="empty"),
    ],
)
def test_is_wsl_release(text: str, expected: bool) -> None:
    assert is_wsl_release(text) is expected


_HEAD = "55d1c9a4b000-55d1c9a4d000 r--p 00000000 fe:00 260386   /usr/bin/python3.11\n"
_LIBC = "7f8a3c000000-7f8a3c028000 r--p 00000000 fe:00 329001   /usr/lib/x86_64-linux-gnu/libc.so.6\n"
_ANON = "7f8a3d000000-7f8a3d021000 rw-p 00000000 00:00 0 \n"
_STACK = "7ffd1e9a2000-7ffd1e9c3000 rw-p 00000000 00:00 0                          [stack]\n"
_PIP_CU13 = "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"
_AUDITWHEEL = "/venv/lib/python3.10/site-packages/torch/lib/../../torch.libs/libcudart-9335f6a2.so.12"
_SYSTEM = "/usr/local/cuda-12.4/targets/x86_64-linux/lib/libcudart.so.12.4.127"
_SPACES = "/home/a user/my env/lib/libcudart.so.12"


def _map(path: str, address: str = "7f8a40000000-7f8a40090000") -> str:
    return f"{address} r-xp 00000000 fe:00 412345                     {path}\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(_HEAD + _LIBC + _map(_PIP_CU13) + _STACK, _PIP_CU13, id="pip-cu13"),
        pytest.param(_HEAD + _map(_AUDITWHEEL) + _ANON, _AUDITWHEEL, id="auditwheel-hash"),
        pytest.param(_map(_SYSTEM), _SYSTEM, id="system-toolkit"),
        pytest.param(_map(_SPACES), _SPACES, id="path-with-spaces"),
        pytest.param(_map(_SYSTEM) + _map(_PIP_CU13), _SYSTEM, id="first-in-address-order"),
        pytest.param(_map(_SYSTEM + " (deleted)") + _map(_PIP_CU13), _PIP_CU13, id="deleted-skipped"),
        pytest.param(_HEAD + _LIBC + _ANON + _STACK, None, id="cpu-only-process"),
        pytest.param(_map("/usr/local/cuda/lib64/libcudart_static.a"), None, id="static-archive"),
        pytest.param(_map("/usr/lib/libcudart_stub.so"), None, id="similar-name"),
        pytest.param(_map("/opt/libcudart.so.12/other.so"), None, id="directory-named-like-it"),
        pytest.param(_map("/usr/lib/libcudart.so.12.py"), None, id="not-a-shared-object"),
        pytest.param("", None, id="empty"),
        pytest.param("not a maps line\n\n", None, id="junk"),
    ],
)
def test_find_libcudart(text: str, expected: str | None) -> None:
    assert find_libcudart(text) == expected


@pytest.mark.parametrize(
    ("text", "major", "expected"),
    [
        pytest.param(_map(_SYSTEM) + _map(_PIP_CU13), "13", _PIP_CU13, id="torch's version over an earlier one"),
        pytest.param(_map(_PIP_CU13) + _map(_SYSTEM), "12", _SYSTEM, id="torch's version over an earlier 13"),
        pytest.param(_map(_SYSTEM) + _map(_AUDITWHEEL), "12", _SYSTEM, id="first of the version"),
        pytest.param(_map(_SYSTEM), "13", _SYSTEM, id="none of the version: the first"),
        pytest.param(_map("/usr/lib/libcudart.so") + _map(_PIP_CU13), "13", _PIP_CU13, id="unversioned-name"),
        pytest.param(_HEAD + _LIBC, "13", None, id="none-at-all"),
    ],
)
def test_find_libcudart_prefers_the_version_torch_was_built_with(text: str, major: str, expected: str | None) -> None:
    assert find_libcudart(text, major) == expected
