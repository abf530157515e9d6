"""Builds ctxpool_torch: the ctypes wrapper plus libctxpool_torch.so.

From the repository root, offline (no PyPI, no torch needed):

    pip install --no-build-isolation --no-index ./plugins/torch/python

The build configures the ctxpool checkout this directory belongs to with
CMake (tests, benchmarks, tools, examples and fuzzers off), builds only the
target ctxpool_torch and puts libctxpool_torch.so inside the package, where
ctxpool_torch.find_library() looks first. The version is the project's, read
from project(ctxpool VERSION x.y.z) in the top-level CMakeLists.txt.

Environment:
  CTXPOOL_SOURCE_DIR          the checkout's root (default: the directory
                              above this file whose CMakeLists.txt is
                              ctxpool's; set it when pip builds a copy)
  CTXPOOL_CMAKE_ARGS          extra CMake configure arguments (shell words;
                              later -D settings win, e.g.
                              -DCMAKE_BUILD_TYPE=RelWithDebInfo)
  CTXPOOL_WITH_CUDA           AUTO (default), ON or OFF
  CMAKE_BUILD_PARALLEL_LEVEL  parallel build jobs (default: the CPUs)
  CTXPOOL_TORCH_BUILD_DIR     where setuptools and CMake build (default:
                              build/ here, which git ignores)
  CMAKE                       the cmake executable (default: cmake on PATH)

Works with setuptools from 42 up and without the `wheel` package (a fresh
venv has none): where no bdist_wheel command exists, the small one below
writes the wheel.
"""

import base64
import contextlib
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
import zipfile

from setuptools import Command, setup
from setuptools.command.build_ext import build_ext as _build_ext
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "ctxpool_torch"
LIBRARY = "libctxpool_torch.so"
_PROJECT_VERSION = re.compile(
    r"^\s*project\s*\(\s*ctxpool\s+VERSION\s+([0-9]+(?:\.[0-9]+){0,3})\b",
    re.IGNORECASE | re.MULTILINE)


def _fail(message):
    raise SystemExit("ctxpool_torch: " + message)


def _project_version(root):
    """project(ctxpool VERSION x.y.z) of root/CMakeLists.txt, or None."""
    try:
        with open(os.path.join(root, "CMakeLists.txt"), encoding="utf-8") as f:
            match = _PROJECT_VERSION.search(f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def _is_checkout(root):
    return (os.path.isfile(os.path.join(root, "plugins", "torch",
                                        "CMakeLists.txt"))
            and _project_version(root) is not None)


def _ancestors(path):
    path = os.path.abspath(path)
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def _source_dir():
    env = os.environ.get("CTXPOOL_SOURCE_DIR")
    if env:
        if not _is_checkout(env):
            _fail("CTXPOOL_SOURCE_DIR=%r is not a ctxpool checkout (it needs "
                  "a CMakeLists.txt with project(ctxpool VERSION ...) and "
                  "plugins/torch/)" % env)
        return os.path.abspath(env)
    # pip >= 21.3 builds a local directory in place: plugins/torch/python is
    # three levels below the root. An older pip builds a copy in a temporary
    # directory; then the directory pip was run from may be the checkout.
    starts = [HERE]
    if os.environ.get("PWD"):
        starts.append(os.environ["PWD"])
    for start in starts:
        for candidate in _ancestors(start):
            if _is_checkout(candidate):
                return candidate
    _fail("cannot find the ctxpool checkout above %s (pip may be building a "
          "copy of plugins/torch/python in a temporary directory); set "
          "CTXPOOL_SOURCE_DIR to the checkout's root, the directory of the "
          "top-level CMakeLists.txt" % HERE)


ROOT = _source_dir()
VERSION = _project_version(ROOT)


def _jobs():
    level = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "").strip()
    if level.isdigit() and int(level) > 0:
        return int(level)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _run(cmd):
    print("ctxpool_torch: " + " ".join(shlex.quote(c) for c in cmd),
          flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        _fail("%s failed with exit status %d (see its output above)"
              % (" ".join(shlex.quote(c) for c in cmd[:3]), rc))


@contextlib.contextmanager
def _locked(path):
    """Serialises builds sharing one CMake tree (two pip runs at once)."""
    with open(path, "a") as f:
        try:
            import fcntl
            fcntl.flock(f, fcntl.LOCK_EX)
        except ImportError:
            pass
        yield


def _cmake_build(build_dir):
    """Configures ROOT in build_dir, builds ctxpool_torch; returns its path."""
    cmake = shutil.which(os.environ.get("CMAKE") or "cmake")
    if not cmake:
        _fail("cmake not found (set CMAKE to its path if it is not on PATH). "
              "Building libctxpool_torch.so needs CMake >= 3.25, a C++20 "
              "compiler and Abseil; on Debian 12 scripts/setup installs them "
              "(cmake ninja-build g++ pkg-config libabsl-dev)")
    extra = shlex.split(os.environ.get("CTXPOOL_CMAKE_ARGS", ""))
    build_type = "Release"
    for arg in extra:
        if arg.startswith("-DCMAKE_BUILD_TYPE="):
            build_type = arg.split("=", 1)[1]
        elif arg.startswith("-DCMAKE_BUILD_TYPE:STRING="):
            build_type = arg.split("=", 1)[1]
    os.makedirs(build_dir, exist_ok=True)
    with _locked(build_dir + ".lock"):
        configure = [cmake, "-S", ROOT, "-B", build_dir]
        if (not os.path.exists(os.path.join(build_dir, "CMakeCache.txt"))
                and not os.environ.get("CMAKE_GENERATOR")
                and shutil.which("ninja")):
            configure += ["-G", "Ninja"]
        cuda = os.environ.get("CTXPOOL_WITH_CUDA") or "AUTO"
        configure += [
            "-DCMAKE_BUILD_TYPE=Release",
            "-DCTXPOOL_WITH_CUDA=" + cuda,
            "-DCTXPOOL_BUILD_TESTS=OFF",
            "-DCTXPOOL_BUILD_BENCHMARKS=OFF",
            "-DCTXPOOL_BUILD_TOOLS=OFF",
            "-DCTXPOOL_BUILD_EXAMPLES=OFF",
            "-DCTXPOOL_BUILD_FUZZERS=OFF",
            "-DCTXPOOL_BUILD_TORCH_PLUGIN=ON",
        ] + extra
        _run(configure)
        _run([cmake, "--build", build_dir, "--target", "ctxpool_torch",
              "--config", build_type, "--parallel", str(_jobs())])
    for candidate in (
            os.path.join(build_dir, "plugins", "torch", LIBRARY),
            os.path.join(build_dir, "plugins", "torch", build_type, LIBRARY)):
        if os.path.isfile(candidate):
            return candidate
    _fail("the build finished but %s is not in %s/plugins/torch"
          % (LIBRARY, build_dir))


class build_ext(_build_ext):
    """Builds libctxpool_torch.so with CMake and copies it into the package.

    Not a Python extension: the library is loaded with ctypes, so it does not
    depend on the Python version (the wheel is py3-none-<platform>).
    """

    def run(self):
        build_base = self.get_finalized_command("build").build_base
        built = _cmake_build(
            os.path.abspath(os.path.join(build_base, "cmake")))
        inplace = self.inplace or getattr(self, "editable_mode", False)
        target_dir = os.path.join(HERE if inplace else self.build_lib, PACKAGE)
        os.makedirs(target_dir, exist_ok=True)
        target = os.path.join(target_dir, LIBRARY)
        partial = "%s.%d.tmp" % (target, os.getpid())
        shutil.copyfile(built, partial)
        os.chmod(partial, 0o755)
        os.replace(partial, target)
        print("ctxpool_torch: %s -> %s" % (built, target), flush=True)

    def get_outputs(self):
        return [os.path.join(self.build_lib, PACKAGE, LIBRARY)]

    def get_output_mapping(self):
        return {}

    def get_source_files(self):
        return []


class BinaryDistribution(Distribution):
    """Platform-specific (a shared library inside): platlib, platform tag."""

    def has_ext_modules(self):
        return True


def _wheel_tag(plat_name):
    plat = plat_name.lower().replace("-", "_").replace(".", "_")
    return ("py3", "none", plat)


def _bdist_wheel_base():
    try:  # setuptools >= 70.1
        from setuptools.command.bdist_wheel import bdist_wheel
        return bdist_wheel
    except ImportError:
        pass
    try:  # the wheel package
        from wheel.bdist_wheel import bdist_wheel
        return bdist_wheel
    except ImportError:
        return None


_BdistWheelBase = _bdist_wheel_base()

if _BdistWheelBase is not None:

    class bdist_wheel(_BdistWheelBase):
        def finalize_options(self):
            super().finalize_options()
            self.root_is_pure = False

        def get_tag(self):
            return _wheel_tag(super().get_tag()[2])

else:

    def _record_hash(path):
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).digest()
        return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(
            b"=").decode("ascii")

    class bdist_wheel(Command):
        """A minimal bdist_wheel for setuptools without the wheel package.

        setuptools.build_meta calls it twice: egg2dist() when pip asks for
        the metadata (dist_info), run() for the wheel. ctxpool_torch has no
        requirements, entry points or scripts, which keeps this small.
        """

        description = "create a wheel (ctxpool_torch's own bdist_wheel)"
        user_options = [
            ("bdist-dir=", "b", "temporary directory for the wheel's tree"),
            ("dist-dir=", "d", "directory to put the wheel in"),
            ("plat-name=", "p", "platform name for the wheel's tag"),
            ("keep-temp", "k", "keep the wheel's tree"),
        ]
        boolean_options = ["keep-temp"]

        def initialize_options(self):
            self.bdist_dir = None
            self.dist_dir = None
            self.plat_name = None
            self.keep_temp = False

        def finalize_options(self):
            if self.bdist_dir is None:
                bdist_base = self.get_finalized_command("bdist").bdist_base
                self.bdist_dir = os.path.join(bdist_base, "ctxpool_wheel")
            if self.dist_dir is None:
                self.dist_dir = "dist"
            if self.plat_name is None:
                self.plat_name = sysconfig.get_platform()

        def _dist_name(self):
            name = re.sub(r"[^\w\d.]+", "_", self.distribution.get_name())
            version = re.sub(r"[^\w\d.+]+", "_",
                             self.distribution.get_version())
            return "%s-%s" % (name, version)

        def _write_dist_info(self, egginfo_path, distinfo_path):
            if os.path.exists(os.path.join(egginfo_path, "requires.txt")):
                with open(os.path.join(egginfo_path, "requires.txt")) as f:
                    if f.read().strip():
                        _fail("the fallback bdist_wheel cannot write "
                              "requirements; install the wheel package")
            if os.path.exists(distinfo_path):
                shutil.rmtree(distinfo_path)
            os.makedirs(distinfo_path)
            shutil.copyfile(os.path.join(egginfo_path, "PKG-INFO"),
                            os.path.join(distinfo_path, "METADATA"))
            for name in ("top_level.txt", "entry_points.txt"):
                source = os.path.join(egginfo_path, name)
                if os.path.exists(source):
                    shutil.copyfile(source, os.path.join(distinfo_path, name))

        def egg2dist(self, egginfo_path, distinfo_path):
            """What wheel's bdist_wheel.egg2dist does (dist_info calls it)."""
            self._write_dist_info(egginfo_path, distinfo_path)
            shutil.rmtree(egginfo_path)

        def run(self):
            build_ext_cmd = self.reinitialize_command("build_ext")
            build_ext_cmd.inplace = False
            self.run_command("build")
            build_lib = self.get_finalized_command("build").build_lib
            self.run_command("egg_info")
            egginfo_path = self.get_finalized_command("egg_info").egg_info

            if os.path.exists(self.bdist_dir):
                shutil.rmtree(self.bdist_dir)
            shutil.copytree(build_lib, self.bdist_dir)
            dist_info = self._dist_name() + ".dist-info"
            distinfo_path = os.path.join(self.bdist_dir, dist_info)
            self._write_dist_info(egginfo_path, distinfo_path)
            tag = _wheel_tag(self.plat_name)
            with open(os.path.join(distinfo_path, "WHEEL"), "w") as f:
                f.write("Wheel-Version: 1.0\n"
                        "Generator: ctxpool_torch setup.py\n"
                        "Root-Is-Purelib: false\n"
                        "Tag: %s\n" % "-".join(tag))

            files = []
            for directory, _, names in os.walk(self.bdist_dir):
                for name in names:
                    path = os.path.join(directory, name)
                    files.append(os.path.relpath(path, self.bdist_dir))
            # The package first, the .dist-info last, RECORD at the very end.
            files.sort(key=lambda p: (p.startswith(dist_info + os.sep), p))
            record = dist_info + "/RECORD"
            lines = []
            for rel in files:
                path = os.path.join(self.bdist_dir, rel)
                lines.append("%s,%s,%d" % (rel.replace(os.sep, "/"),
                                           _record_hash(path),
                                           os.path.getsize(path)))
            lines.append(record + ",,")
            with open(os.path.join(self.bdist_dir, record), "w") as f:
                f.write("\n".join(lines) + "\n")

            os.makedirs(self.dist_dir, exist_ok=True)
            wheel = os.path.join(self.dist_dir, "%s-%s.whl"
                                 % (self._dist_name(), "-".join(tag)))
            with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
                for rel in files + [record]:
                    zf.write(os.path.join(self.bdist_dir, rel),
                             rel.replace(os.sep, "/"))
            print("ctxpool_torch: wrote %s" % wheel, flush=True)
            if not self.keep_temp:
                shutil.rmtree(self.bdist_dir)


_options = {}
_build_dir = os.environ.get("CTXPOOL_TORCH_BUILD_DIR")
if _build_dir:
    _build_dir = os.path.abspath(_build_dir)
    os.makedirs(_build_dir, exist_ok=True)
    _options = {"build": {"build_base": _build_dir},
                "egg_info": {"egg_base": _build_dir}}

setup(
    name="ctxpool_torch",
    version=VERSION,
    description="ctxpool as PyTorch's CUDA allocator (libctxpool_torch.so "
                "over ctypes)",
    packages=[PACKAGE],
    python_requires=">=3.8",
    zip_safe=False,
    distclass=BinaryDistribution,
    cmdclass={"build_ext": build_ext, "bdist_wheel": bdist_wheel},
    options=_options,
)
