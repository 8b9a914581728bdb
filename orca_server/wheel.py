"""The ``nvidia-pytriton`` wheel's layout: where its Triton lives and what running it takes.

Why this module exists: the ``nvidia-pytriton`` wheel ships the ``tritonserver``
binary, the Python backend (``libtriton_python.so`` plus
``triton_python_backend_utils.py``) and one Python backend *stub* per CPython
version, but it lays them out for PyTriton's own use.  To serve our decoupled
Python-backend model we need to

* assemble a backend directory ``<dir>/python/`` holding the backend library,
  its utils module and the stub built for *this* interpreter (Triton looks for
  the stub next to ``libtriton_python.so``);
* give the binaries a library path with the wheel's bundled ``.libs`` folder and
  the interpreter's ``libpython3.X.so`` (the stub links against it, and without
  our interpreter's LIBDIR it may pick up a different system libpython);
* make the stub's embedded interpreter use *this* environment's packages: it
  runs with an isolated config that ignores ``PYTHONPATH``, so we put this
  interpreter's ``bin`` first on ``PATH`` (see :func:`server_env`).

This module owns that knowledge: locating the wheel's files
(:func:`find_pytriton_paths`, :class:`PyTritonPaths`), assembling the backend
directory (:func:`prepare_backend_dir`, :func:`default_backend_dir`) and the
environment of the binaries (:func:`server_env`), plus :class:`TritonServerError`,
which the rest of :mod:`orca_server` raises too.  It starts nothing: the process
is :mod:`orca_server.server`'s, the command line :mod:`orca_server.launcher`'s.

Everything here only reads the wheel's files; PyTriton's Python API is never
imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import sys
import sysconfig
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
STUB_NAME = "triton_python_backend_stub"


class TritonServerError(RuntimeError):
    """Triton could not be located, prepared, started or became unhealthy."""


@dataclasses.dataclass(frozen=True)
class PyTritonPaths:
    """Where the pieces of Triton live inside the installed ``nvidia-pytriton`` wheel."""

    package_dir: Path
    tritonserver: Path
    python_backend_dir: Path
    backend_files: tuple[Path, ...]
    stub: Path
    libs_dir: Path
    caches_dir: Path


def _python_tag(version: tuple[int, int] | None = None) -> str:
    major, minor = version if version is not None else sys.version_info[:2]
    return f"{major}.{minor}"


def find_pytriton_paths(python_version: tuple[int, int] | None = None) -> PyTritonPaths:
    """Locate the Triton binary, Python backend, stub and bundled libs in the wheel.

    Uses :func:`importlib.util.find_spec`, which finds the top-level ``pytriton``
    package without executing its ``__init__`` (PyTriton's API pulls in heavy
    dependencies and we use none of it).

    Args:
        python_version: ``(major, minor)`` of the stub to pick; defaults to the
            running interpreter, whose site-packages the stub will be given.

    Raises:
        TritonServerError: the wheel is missing, or it lacks a required file
            (for instance no stub for this Python version).
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonServerError("package 'pytriton' not found: install nvidia-pytriton (scripts/setup_venv.sh)")
    package_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    root = package_dir / "tritonserver"
    tag = _python_tag(python_version)
    paths = PyTritonPaths(
        package_dir=package_dir,
        tritonserver=root / "bin" / "tritonserver",
        python_backend_dir=root / "backends" / "python",
        backend_files=tuple(root / "backends" / "python" / name for name in BACKEND_FILES),
        stub=root / "python_backend_stubs" / tag / STUB_NAME,
        libs_dir=package_dir.parent / "nvidia_pytriton.libs",
        caches_dir=root / "caches",
    )
    required = (paths.tritonserver, *paths.backend_files, paths.stub, paths.libs_dir)
    missing = [str(p) for p in required if not p.exists()]
    if missing:
        stubs = sorted(p.name for p in (root / "python_backend_stubs").glob("*"))
        raise TritonServerError(
            f"nvidia-pytriton at {package_dir} lacks {missing} (Python {tag}; stubs shipped for: {stubs or 'none'})"
        )
    return paths


def _link_or_copy(src: Path, dst: Path, *, copy: bool) -> None:
    """Make ``dst`` point at (or be a copy of) ``src``; no-op if already so.

    Replacement goes through a temporary name and :func:`os.replace` so that a
    concurrently starting server never sees a half-written file.
    """
    if copy:
        if (
            dst.is_file()
            and not dst.is_symlink()
            and dst.stat().st_size == src.stat().st_size
            and dst.stat().st_mtime_ns >= src.stat().st_mtime_ns
        ):
            return
    elif dst.is_symlink() and Path(os.readlink(dst)) == src:
        return
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}")
    try:
        if copy:
            shutil.copy2(src, tmp)
        else:
            tmp.symlink_to(src)
        os.replace(tmp, dst)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def prepare_backend_dir(dest: Path, *, copy: bool = False, paths: PyTritonPaths | None = None) -> Path:
    """Create ``dest/python/`` with the Python backend and this Python's stub.

    Triton loads backend ``python`` from ``<backend-directory>/python/`` and the
    backend launches ``triton_python_backend_stub`` from that same folder, so
    the stub matching our interpreter must sit beside ``libtriton_python.so``.
    Symlinks are the default (cheap, and they follow a reinstalled wheel); the
    stub's RPATH is ``$ORIGIN``-relative and the loader resolves ``$ORIGIN`` of
    an executable through the symlink, and :func:`server_env` sets the library
    path anyway, so copies (``copy=True``) work too.  Idempotent.

    Returns:
        ``dest`` (resolved), the value for ``--backend-directory``.
    """
    paths = paths or find_pytriton_paths()
    dest = Path(dest).resolve()
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in (*paths.backend_files, paths.stub):
        _link_or_copy(src, python_dir / src.name, copy=copy)
    return dest


def default_backend_dir() -> Path:
    """A persistent per-environment backend directory for the CLI.

    Inside a virtualenv it lives in the venv (tied to its interpreter and its
    wheel); otherwise in the user's cache directory, keyed by Python version.
    """
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "triton_backends"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "orca" / f"triton_backends-py{_python_tag()}"


def _join_paths(parts: Iterable[str | os.PathLike[str] | None]) -> str:
    """Join path-list entries with ``os.pathsep``, dropping empties and duplicates."""
    seen: list[str] = []
    for part in parts:
        for item in str(part or "").split(os.pathsep):
            if item and item not in seen:
                seen.append(item)
    return os.pathsep.join(seen)


def server_env(
    base: Mapping[str, str] | None = None,
    *,
    paths: PyTritonPaths | None = None,
) -> dict[str, str]:
    """Environment for ``tritonserver`` and the Python backend stubs it spawns.

    * ``PATH``: the running interpreter's ``bin`` directory first.  The stub
      embeds Python with an *isolated* config (``PyConfig_InitIsolatedConfig``),
      so it ignores ``PYTHONPATH``/``PYTHONHOME``; it finds its prefix the way
      ``python3`` would, by looking ``python3`` up on ``PATH``.  With a venv's
      ``bin`` first it finds ``pyvenv.cfg``, so ``sys.prefix`` is the venv and
      the venv's site-packages (``.pth`` files and editable installs included)
      are on the stub's ``sys.path``.  Without this the stub imports the base
      interpreter's packages (seen: numpy 2.x instead of the venv's 1.26).
    * ``LD_LIBRARY_PATH``: the wheel's ``nvidia_pytriton.libs`` (libtritonserver,
      libcudart...) and this interpreter's LIBDIR first, so the stub loads the
      ``libpython3.X.so`` of this interpreter, not a system one of the same
      minor version (``/lib/x86_64-linux-gnu`` has Debian's 3.11 here).
    * ``PYTHONUNBUFFERED``: model prints reach the server log promptly.

    The repository root is *not* put on the stub's path by the environment
    (nothing but ``PATH`` is honoured): ``pip install -e .`` makes the project
    importable, as ``scripts/setup_venv.sh`` does.

    Args:
        base: environment to extend; defaults to ``os.environ``.  Existing
            ``PATH``/``LD_LIBRARY_PATH`` entries are kept after ours.
        paths: wheel layout, from :func:`find_pytriton_paths` if not given.
    """
    paths = paths or find_pytriton_paths()
    env = dict(os.environ if base is None else base)
    # Not resolved: a venv's bin/python3 is a symlink, and resolving it would
    # lose the pyvenv.cfg next to it.
    interpreter_bin = Path(sys.executable).absolute().parent
    env["PATH"] = _join_paths([interpreter_bin, env.get("PATH") or os.defpath])
    libdir = sysconfig.get_config_var("LIBDIR")
    env["LD_LIBRARY_PATH"] = _join_paths([paths.libs_dir, libdir, env.get("LD_LIBRARY_PATH")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
