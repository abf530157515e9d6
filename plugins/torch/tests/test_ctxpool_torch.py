"""Tests of the ctxpool_torch Python wrapper that need no GPU.

Run by ctest (torch_plugin_python) with CTXPOOL_TORCH_LIB naming the built
library, CTXPOOL_DRIVER=sim:2xa10-24gb and PYTHONPATH=plugins/torch/python:

    python3 -m unittest discover -s plugins/torch/tests -v

Tests that need the library skip when CTXPOOL_TORCH_LIB is unset; tests
that need torch or CUDA skip when they are missing.
"""

import ctypes
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import unittest
from unittest import mock

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "python"))
# The simulated driver unless the caller chose one (before the library loads).
os.environ.setdefault("CTXPOOL_DRIVER", "sim:2xa10-24gb")

import ctxpool_torch  # noqa: E402

_HAVE_TORCH = importlib.util.find_spec("torch") is not None
_LIB = os.environ.get("CTXPOOL_TORCH_LIB")
_SYSTEM_LIB = any(
    os.path.isfile(os.path.join(d, ctxpool_torch.LIBRARY_NAME))
    for d in ("/usr/local/lib", "/usr/lib"))


def _torch_cuda_available():
    if not _HAVE_TORCH:
        return False
    import torch
    return torch.cuda.is_available()


class ImportTest(unittest.TestCase):

    def test_import_needs_no_torch(self):
        # Importing the wrapper must not import torch.
        self.assertTrue(hasattr(ctxpool_torch, "install"))
        if not _HAVE_TORCH:
            self.assertNotIn("torch", sys.modules)

    def test_find_library_reports_a_bad_path(self):
        with self.assertRaises(FileNotFoundError) as cm:
            ctxpool_torch.find_library("/nonexistent/libctxpool_torch.so")
        self.assertIn("/nonexistent", str(cm.exception))


class CheckoutFallbackTest(unittest.TestCase):
    """find_library() in a fake checkout, without CTXPOOL_TORCH_LIB: next to
    the package, then scripts/test's out/main, the other out/* trees, then
    build*/; a sanitized tree's library is never chosen."""

    def setUp(self):
        tmp = tempfile.TemporaryDirectory(prefix="ctxpool-fake-checkout-")
        self.addCleanup(tmp.cleanup)
        self.root = tmp.name
        self.package = os.path.join(self.root, "plugins", "torch", "python",
                                    "ctxpool_torch")
        os.makedirs(self.package)
        with open(os.path.join(self.root, "plugins", "torch",
                               "CMakeLists.txt"), "w"):
            pass
        init = os.path.join(self.package, "__init__.py")
        shutil.copyfile(ctxpool_torch.__file__, init)
        spec = importlib.util.spec_from_file_location(
            "ctxpool_torch_fake_checkout", init)
        self.module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.module)
        env = mock.patch.dict(os.environ)
        env.start()
        self.addCleanup(env.stop)
        os.environ.pop("CTXPOOL_TORCH_LIB", None)

    def _library(self, build, sanitize=None):
        """A fake library in root/build (with a CMakeCache.txt that records
        CTXPOOL_SANITIZE when ``sanitize`` is not None)."""
        directory = os.path.join(self.root, build, "plugins", "torch")
        os.makedirs(directory)
        if sanitize is not None:
            with open(os.path.join(self.root, build, "CMakeCache.txt"),
                      "w") as f:
                f.write("CMAKE_BUILD_TYPE:STRING=Debug\n"
                        "CTXPOOL_SANITIZE:STRING=%s\n" % sanitize)
        path = os.path.join(directory, ctxpool_torch.LIBRARY_NAME)
        with open(path, "w"):
            pass
        return path

    def test_out_main_then_other_out_trees_then_build_dirs(self):
        build = self._library("build")
        tsa = self._library(os.path.join("out", "clang-tsa"), sanitize="")
        self._library(os.path.join("out", "asan-ubsan"),
                      sanitize="address,undefined")
        main = self._library(os.path.join("out", "main"), sanitize="")
        self.assertEqual(self.module.find_library(), main)
        os.remove(main)
        self.assertEqual(self.module.find_library(), tsa)
        os.remove(tsa)
        self.assertEqual(self.module.find_library(), build)

    def test_next_to_the_package_comes_first(self):
        self._library(os.path.join("out", "main"))
        beside = os.path.join(self.package, ctxpool_torch.LIBRARY_NAME)
        with open(beside, "w"):
            pass
        self.assertEqual(self.module.find_library(), beside)

    @unittest.skipIf(_SYSTEM_LIB, "a system libctxpool_torch.so is present")
    def test_sanitized_only_is_not_found_and_the_error_says_how(self):
        self._library(os.path.join("out", "asan-ubsan"), sanitize="address")
        os.makedirs(os.path.join(self.root, "out", "main"))
        with self.assertRaises(FileNotFoundError) as cm:
            self.module.find_library()
        text = str(cm.exception)
        self.assertIn(os.path.join(self.root, "out", "main", "plugins",
                                   "torch", ctxpool_torch.LIBRARY_NAME), text)
        self.assertNotIn("asan-ubsan", text)
        self.assertIn("pip install --no-build-isolation --no-index "
                      "./plugins/torch/python", text)


class InstallWithoutCudaTest(unittest.TestCase):

    @unittest.skipIf(_torch_cuda_available(), "torch with CUDA is present")
    def test_install_raises_a_clear_error(self):
        with self.assertRaises(RuntimeError) as cm:
            ctxpool_torch.install(_LIB)
        text = str(cm.exception)
        if _HAVE_TORCH:
            self.assertIn("torch.cuda.is_available() is False", text)
        else:
            self.assertIn("needs PyTorch", text)
        self.assertFalse(ctxpool_torch.installed())


@unittest.skipUnless(_LIB, "CTXPOOL_TORCH_LIB is not set")
class SimulatedDriverTest(unittest.TestCase):
    """The ctypes layer on the simulated driver (no GPU, no torch)."""

    def setUp(self):
        self.lib = ctxpool_torch.library(_LIB)
        self.assertEqual(ctxpool_torch.info()["driver"], "sim")
        ctxpool_torch.set_model(None)

    def tearDown(self):
        ctxpool_torch.set_model(None)
        self.assertEqual(self.lib.ctxpool_shutdown(1), 0,
                         ctxpool_torch.last_error())

    def test_malloc_and_free_with_a_null_stream(self):
        p = self.lib.ctxpool_try_malloc(1000, 0, None)
        self.assertTrue(p)
        stats = ctxpool_torch.memory_stats(0)
        self.assertEqual(stats["allocation.all.current"], 1)
        self.assertEqual(stats["requested_bytes.all.current"], 1000)
        self.assertGreaterEqual(stats["allocated_bytes.all.current"], 1000)
        self.lib.ctxpool_free(p, 1000, 0, None)
        stats = ctxpool_torch.memory_stats(0)
        self.assertEqual(stats["allocation.all.current"], 0)
        self.assertEqual(stats["num_invalid_frees"], 0)
        self.assertGreater(ctxpool_torch.empty_cache(), 0)
        self.assertEqual(
            ctxpool_torch.memory_stats(0)["reserved_bytes.all.current"], 0)

    def test_memory_stats_keys_are_pytorchs(self):
        stats = ctxpool_torch.memory_stats()
        for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                    "reserved_bytes.all.current", "reserved_bytes.all.peak",
                    "active_bytes.all.current",
                    "inactive_split_bytes.all.current",
                    "allocated_bytes.small_pool.current",
                    "reserved_bytes.large_pool.peak", "num_alloc_retries",
                    "num_ooms", "allocation.all.current",
                    "segment.all.current"):
            self.assertIn(key, stats)
            self.assertIsInstance(stats[key], int)
        self.assertIsInstance(stats["models"], dict)

    def test_bad_frees_are_counted(self):
        p = self.lib.ctxpool_try_malloc(4096, 0, None)
        self.lib.ctxpool_free(p, 4095, 0, None)
        self.assertIn("was 4096 bytes", ctxpool_torch.last_error())
        self.lib.ctxpool_free(12345, 16, 0, None)
        self.assertIn("not a live allocation", ctxpool_torch.last_error())
        self.assertEqual(
            ctxpool_torch.memory_stats(0)["num_invalid_frees"], 2)
        self.lib.ctxpool_free(p, 4096, 0, None)

    def test_try_malloc_out_of_memory_gives_null_and_an_error(self):
        self.assertIsNone(self.lib.ctxpool_try_malloc(100 << 30, 0, None))
        self.assertIn("larger than", ctxpool_torch.last_error())

    def test_model_context_manager(self):
        self.assertEqual(ctxpool_torch.get_model(), "default")
        ctxpool_torch.set_model_budget("tiny", 1 << 20)
        with ctxpool_torch.model("bert") as name:
            self.assertEqual(name, "bert")
            self.assertEqual(ctxpool_torch.get_model(), "bert")
            a = self.lib.ctxpool_try_malloc(2 << 20, 0, None)
            with ctxpool_torch.model("tiny"):
                b = self.lib.ctxpool_try_malloc(512 << 10, 0, None)
                self.assertIsNone(self.lib.ctxpool_try_malloc(1 << 20, 0, None))
                self.assertIn("tiny", ctxpool_torch.last_error())
            self.assertEqual(ctxpool_torch.get_model(), "bert")
        self.assertEqual(ctxpool_torch.get_model(), "default")
        models = ctxpool_torch.memory_stats(0)["models"]
        self.assertEqual(models["bert"]["live_bytes"], 2 << 20)
        self.assertEqual(models["tiny"]["live_bytes"], 512 << 10)
        self.assertEqual(models["tiny"]["max_bytes"], 1 << 20)
        self.assertEqual(models["tiny"]["num_budget_rejections"], 1)
        self.lib.ctxpool_free(a, 2 << 20, 0, None)
        self.lib.ctxpool_free(b, 512 << 10, 0, None)
        with self.assertRaises(RuntimeError):
            ctxpool_torch.set_model_budget("bert", 1 << 30)  # already used

    def test_model_is_restored_after_an_exception(self):
        with self.assertRaises(KeyError):
            with ctxpool_torch.model("t5"):
                raise KeyError("x")
        self.assertEqual(ctxpool_torch.get_model(), "default")

    def test_model_is_per_thread(self):
        seen = []
        with ctxpool_torch.model("main"):
            t = threading.Thread(
                target=lambda: seen.append(ctxpool_torch.get_model()))
            t.start()
            t.join()
        self.assertEqual(seen, ["default"])

    def test_model_stream_and_record_stream(self):
        with ctxpool_torch.model("bert"):
            stream = ctxpool_torch.model_stream(0)
            self.assertTrue(stream)
            p = self.lib.ctxpool_try_malloc(1 << 20, 0, None)
            ctxpool_torch.record_stream(p, stream)
            self.lib.ctxpool_free(p, 1 << 20, 0, None)
            with self.assertRaises(RuntimeError):
                ctxpool_torch.record_stream(p, stream)  # freed

    def test_snapshot_writes_json(self):
        p = self.lib.ctxpool_try_malloc(4096, 1, None)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "snap.json")
            ctxpool_torch.snapshot(path)
            with open(path) as f:
                snap = json.load(f)
            self.assertEqual(len(snap["devices"]), 1)
            self.assertEqual(snap["devices"][0]["device"], 1)
        self.lib.ctxpool_free(p, 4096, 1, None)

    def test_bad_device_raises(self):
        with self.assertRaises(RuntimeError) as cm:
            ctxpool_torch.memory_stats(5)
        self.assertIn("does not exist", str(cm.exception))

    def test_works_with_ctypes_pointers(self):
        p = self.lib.ctxpool_try_malloc(0, 0, ctypes.c_void_p(0))
        self.assertTrue(p)
        self.lib.ctxpool_free(p, 0, 0, None)
        self.assertEqual(
            ctxpool_torch.memory_stats(0)["num_invalid_frees"], 0)


if __name__ == "__main__":
    unittest.main()
