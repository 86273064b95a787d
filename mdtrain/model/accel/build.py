"""Building the compiled kernels (every ``csrc/*.cpp``, one library) for this machine.

They are built with the system's C++ compiler (``$CXX``, else ``c++``) for this CPU
(``-march=native``), against the OpenMP runtime torch already loaded, and cached under
``$MDTRAIN_CACHE_DIR`` (default ``~/.cache/mdtrain``) by a hash of the source, the compiler,
torch and the CPU, so that each machine type compiles once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from mdtrain.cache_dir import cache_dir

log = logging.getLogger("mdtrain.model.accel")

SOURCES = sorted(Path(__file__).with_name("csrc").glob("*.cpp"))
HEADERS = sorted(Path(__file__).with_name("csrc").glob("*.h"))  # in the cache key, not compiled


def _cpu_signature() -> str:
    """The CPU model and feature flags: a build for one CPU must not run on another."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def torch_lib_dir() -> Path:
    return Path(torch.__file__).parent / "lib"


def _openmp_link_args() -> list[str]:
    """Link against the OpenMP runtime torch uses, so that both share one thread pool."""
    bundled = sorted(torch_lib_dir().glob("libgomp*.so*"))
    if bundled:
        return [str(bundled[0]), f"-Wl,-rpath,{bundled[0].parent}"]
    return []


def build(compiler: str) -> Path:
    """Compile the kernels (or find them in the cache); raises ``RuntimeError`` with the reason."""
    # -fno-trapping-math lets the tanh loops (with their clamp) vectorise: 3-4x faster layers,
    # the same values (no reassociation, no contraction other than -O3's own FMAs)
    flags = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared",
             "-std=c++17"]  # fmt: skip
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"no C++ compiler ({compiler}): {exc}") from None
    link = _openmp_link_args()
    key = hashlib.sha256(
        "\0".join(
            [
                *(source.read_text() for source in SOURCES + HEADERS),
                version,
                " ".join(flags + link),
                torch.__version__,
                _cpu_signature(),
            ]
        ).encode()
    ).hexdigest()[:16]
    name = f"embedding-{key}.so"
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"mdtrain-{os.getuid()}"):
        target = folder / name
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            break
    else:
        raise RuntimeError(f"no writable folder for the build ({cache_dir()})")
    # Several ranks may build at once: each writes its own file and renames it into place.
    log.info("building the compiled embedding kernels (once per machine type): %s", target)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", tmp, *link],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if result.returncode != 0:
            first = (result.stderr.strip().splitlines() or ["(no output)"])[0]
            raise RuntimeError(f"compiling the kernels failed: {first}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
