#!/usr/bin/env python3
"""ctest torch_pip_install: the PyTorch plugin's package installs offline.

Run by ctest (tests/torch_plugin.cmake):

    torch_pip_install_test.py --source DIR --work DIR --version X.Y.Z
                              [--cmake-arg ARG ...]

1. Creates a fresh venv in --work (python3 -m venv; ensurepip brings pip and
   setuptools, no network).
2. pip install --no-build-isolation --no-index DIR/plugins/torch/python into
   it: setup.py builds libctxpool_torch.so with CMake (in --work/build, kept
   between runs so a rerun is incremental; --cmake-arg values go first in
   CTXPOOL_CMAKE_ARGS, the build's compiler and launcher; the build uses
   CMAKE_BUILD_PARALLEL_LEVEL or every CPU).
3. From a temporary directory outside the checkout, with no PYTHONPATH and no
   CTXPOOL_TORCH_LIB, on CTXPOOL_DRIVER=sim:2xa10-24gb: imports ctxpool_torch,
   calls memory_stats() and info(), and checks that the package and the
   library it loaded are the venv's, the installed version is --version, and
   the stats have PyTorch's keys.

Exits 0 when all passes, 1 on any failure (the install or the import
included), 77 (ctest: skipped) only when python3 has no working
venv/ensurepip (Debian: apt-get install python3-venv).
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

SKIP = 77
DRIVER = "sim:2xa10-24gb"
EXPECTED_KEYS = (
    "allocated_bytes.all.current", "allocated_bytes.all.peak",
    "reserved_bytes.all.current", "reserved_bytes.all.peak",
    "active_bytes.all.current", "allocation.all.current",
    "segment.all.current", "num_alloc_retries", "num_ooms",
    "num_invalid_frees",
)

PROBE = r"""
import importlib.metadata, json, sys
import ctxpool_torch
stats = ctxpool_torch.memory_stats()
print(stats)
print("CTXPOOL_PROBE " + json.dumps({
    "package": ctxpool_torch.__file__,
    "library": ctxpool_torch._lib_path,
    "found": ctxpool_torch.find_library(),
    "version": importlib.metadata.version("ctxpool_torch"),
    "torch_imported": "torch" in sys.modules,
    "info": ctxpool_torch.info(),
    "stats": stats,
}))
"""


def log(message):
    print("torch_pip_install: " + message, flush=True)


def fail(message):
    log("FAILED: " + message)
    sys.exit(1)


def skip(message):
    log("SKIPPED: " + message)
    sys.exit(SKIP)


def run(cmd, what, env=None, cwd=None, check=True):
    log("%s: %s" % (what, " ".join(shlex.quote(c) for c in cmd)))
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    log("%s: exit %d after %.0f s" % (what, proc.returncode,
                                      time.monotonic() - t0))
    if check and proc.returncode != 0:
        print(proc.stdout, flush=True)
        fail("%s failed (exit %d); its output is above" % (what,
                                                          proc.returncode))
    return proc


def inside(path, directory):
    path = os.path.realpath(path)
    directory = os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def create_venv(venv, system_site_packages=False):
    shutil.rmtree(venv, ignore_errors=True)
    cmd = [sys.executable, "-m", "venv"]
    if system_site_packages:
        cmd.append("--system-site-packages")
    proc = run(cmd + [venv], "python3 -m venv", check=False)
    if proc.returncode != 0:
        print(proc.stdout, flush=True)
        if "ensurepip" in proc.stdout:
            skip("python3 -m venv cannot bootstrap pip: ensurepip is not "
                 "available (Debian: apt-get install python3-venv)")
        fail("python3 -m venv failed (exit %d)" % proc.returncode)
    python = os.path.join(venv, "bin", "python")
    has_setuptools = subprocess.run(
        [python, "-c", "import setuptools"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL).returncode == 0
    return python, has_setuptools


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--source", required=True, help="the checkout's root")
    parser.add_argument("--work", required=True, help="scratch directory")
    parser.add_argument("--version", required=True,
                        help="the project's version (PROJECT_VERSION)")
    parser.add_argument("--cmake-arg", action="append", default=[],
                        help="a CMake argument for the pip build")
    args = parser.parse_args()
    source = os.path.abspath(args.source)
    work = os.path.abspath(args.work)
    package_dir = os.path.join(source, "plugins", "torch", "python")

    try:
        import ensurepip  # noqa: F401  (only whether they exist)
        import venv  # noqa: F401
    except ImportError as e:
        skip("python3 has no venv/ensurepip module (%s; Debian: apt-get "
             "install python3-venv)" % e)

    os.makedirs(work, exist_ok=True)
    venv_dir = os.path.join(work, "venv")
    python, has_setuptools = create_venv(venv_dir)
    if not has_setuptools:
        # Python >= 3.12's ensurepip no longer installs setuptools: use the
        # system's (python3-setuptools) through the venv.
        log("the venv has no setuptools; recreating it with "
            "--system-site-packages")
        python, has_setuptools = create_venv(venv_dir, True)
        if not has_setuptools:
            fail("setuptools is not available to %s (neither ensurepip's nor "
                 "the system's; Debian: apt-get install python3-setuptools)"
                 % sys.executable)

    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONHOME", "CTXPOOL_TORCH_LIB",
                 "CTXPOOL_SOURCE_DIR", "PIP_REQUIRE_VIRTUALENV"):
        env.pop(name, None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INPUT"] = "1"
    env["PYTHONNOUSERSITE"] = "1"
    env["CTXPOOL_TORCH_BUILD_DIR"] = os.path.join(work, "build")
    cmake_args = " ".join(shlex.quote(a) for a in args.cmake_arg)
    if env.get("CTXPOOL_CMAKE_ARGS"):
        cmake_args += " " + env["CTXPOOL_CMAKE_ARGS"]
    env["CTXPOOL_CMAKE_ARGS"] = cmake_args.strip()
    if not env.get("CMAKE_BUILD_PARALLEL_LEVEL", "").strip():
        try:
            env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(
                len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(os.cpu_count() or 1)
    log("CMAKE_BUILD_PARALLEL_LEVEL=%s CTXPOOL_CMAKE_ARGS=%s"
        % (env["CMAKE_BUILD_PARALLEL_LEVEL"], env["CTXPOOL_CMAKE_ARGS"]))

    run([python, "-m", "pip", "install", "--no-build-isolation",
         "--no-index", package_dir], "pip install", env=env, cwd=work)

    probe_env = dict(env)
    probe_env.pop("CTXPOOL_TORCH_BUILD_DIR")
    probe_env["CTXPOOL_DRIVER"] = DRIVER
    with tempfile.TemporaryDirectory(prefix="ctxpool-pip-probe-") as outside:
        if inside(outside, source):
            fail("the temporary directory %s is inside the checkout %s; set "
                 "TMPDIR elsewhere" % (outside, source))
        # -I: no PYTHONPATH, no user site, no script or current directory on
        # sys.path; only what the venv has.
        proc = run([python, "-I", "-c", PROBE], "import ctxpool_torch",
                   env=probe_env, cwd=outside)
    print(proc.stdout.rstrip(), flush=True)
    lines = [l for l in proc.stdout.splitlines()
             if l.startswith("CTXPOOL_PROBE ")]
    if len(lines) != 1:
        fail("the probe printed no result")
    got = json.loads(lines[0][len("CTXPOOL_PROBE "):])

    problems = []
    for what in ("package", "library", "found"):
        path = got[what] or ""
        if not inside(path, venv_dir):
            problems.append("%s %r is not inside the venv %s"
                            % (what, path, venv_dir))
        elif inside(path, package_dir):
            problems.append("%s %r is the checkout's, not the installed one"
                            % (what, path))
    if os.path.basename(got["library"] or "") != "libctxpool_torch.so":
        problems.append("loaded %r, not libctxpool_torch.so" % got["library"])
    if got["version"] != args.version:
        problems.append("installed version %r, the project's is %r"
                        % (got["version"], args.version))
    if got["torch_imported"]:
        problems.append("importing ctxpool_torch imported torch")
    if got["info"].get("driver") != "sim":
        problems.append("driver %r, expected sim (CTXPOOL_DRIVER=%s)"
                        % (got["info"].get("driver"), DRIVER))
    stats = got["stats"]
    if not isinstance(stats, dict):
        problems.append("memory_stats() returned %r, not a dict"
                        % type(stats).__name__)
    else:
        for key in EXPECTED_KEYS:
            if not isinstance(stats.get(key), int):
                problems.append("memory_stats()[%r] is %r, not an int"
                                % (key, stats.get(key)))
        if not isinstance(stats.get("models"), dict):
            problems.append("memory_stats()['models'] is not a dict")
    if problems:
        fail("; ".join(problems))
    log("passed: %s %s loaded %s" % (got["package"], got["version"],
                                     got["library"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
