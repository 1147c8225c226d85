"""The README's "From Python and C" snippets, run as the README says: the Python example
and the C example (compiled against capi/cudapool.h where a C compiler is)."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from helpers import CHILD_TIMEOUT, HERE

from cudapool import _lib

ROOT = os.path.dirname(os.path.dirname(HERE))


# What the test helpers set for every child (helpers.py) and a newcomer's shell has not:
# the README's examples must run without them.
HELPER_ENV = ("CUDAPOOL_RUNTIME", "CUDAPOOL_DIR")


def run(test, argv, **env):
    e = {k: v for k, v in os.environ.items() if k not in HELPER_ENV}
    e.update(env)
    out = subprocess.run(argv, cwd=ROOT, env=e, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    test.assertEqual(out.returncode, 0, "%s failed:\n%s%s" % (argv, out.stdout, out.stderr))
    return out.stdout


class ExamplesTest(unittest.TestCase):
    """The examples run as a newcomer runs them on a machine without a GPU: against the
    library built with -tags cudapool_softdevice (as the tests' is), without the
    helpers' CUDAPOOL_RUNTIME=auto, so that a child that forgets to choose its runtime
    fails here as it does for them."""

    def test_python_example(self):
        out = run(self, [sys.executable, "examples/python/share.py"], PYTHONPATH=os.path.join(ROOT, "python"))
        self.assertIn("consumer read 'hello from a Python producer'", out)

    def test_python_vmm_example(self):
        out = run(self, [sys.executable, "examples/python/vmm_share.py"], PYTHONPATH=os.path.join(ROOT, "python"))
        self.assertIn("as one range", out)
        self.assertIn("across a boundary: '--------chunk 2 starts here'", out)

    def test_pip_install(self):
        """pip install of a copy of python/, as the README says, puts the library beside
        the package, where the installed cudapool finds it without $CUDAPOOL_LIB. It needs
        pip alone: with setuptools 65 and no wheel package it failed (invalid command
        'bdist_wheel', issue 31); python/_build.py builds the wheel."""
        if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                          timeout=CHILD_TIMEOUT).returncode:
            self.skipTest("no pip to install with")
        tmp = tempfile.mkdtemp()
        src, site = os.path.join(tmp, "src"), os.path.join(tmp, "site")
        shutil.copytree(os.path.join(ROOT, "python"), src,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "tests", "*.egg-info", "build"))
        for isolation in (["--no-build-isolation"], []):  # the README's, and pip's default: no registry either way
            run(self, [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--target", site] + isolation +
                ["--upgrade", src], CUDAPOOL_LIB=_lib.library_path())
        env = {k: v for k, v in os.environ.items() if k not in ("CUDAPOOL_LIB", "PYTHONPATH")}
        out = subprocess.run([sys.executable, "-c", "import cudapool, sys; sys.stdout.write(cudapool.library_path())"],
                             cwd=tmp, env=dict(env, PYTHONPATH=site), capture_output=True, text=True,
                             timeout=CHILD_TIMEOUT)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout, os.path.join(site, "cudapool", "libcudapool.so"))
        self.assertTrue(os.path.exists(os.path.join(site, "cudapool", "py.typed")))

    def test_torch_pairs_run_the_go_commands_there_are(self):
        """examples/torch/pairs.py runs the Go example as a program that
        scripts/build-gpu.sh builds (a main package's folder names it), with a
        subcommand it has: it ran producer and consumer programs that had become
        kvshare's subcommands (issue 31)."""
        sys.path.insert(0, os.path.join(ROOT, "examples", "torch"))
        try:
            import pairs
        finally:
            sys.path.pop(0)
        bindir = tempfile.mkdtemp()
        with self.assertRaisesRegex(FileNotFoundError, "build-gpu.sh"):
            pairs.kvshare(bindir, "producer")
        open(os.path.join(bindir, "kvshare"), "w").close()
        for role in ("producer", "consumer"):
            argv = pairs.kvshare(bindir, role, "-runtime", "gpu")
            name = os.path.basename(argv[0])
            self.assertTrue(any(os.path.isfile(os.path.join(ROOT, top, name, "main.go")) for top in ("cmd", "examples")),
                            "%s is no command build-gpu.sh builds" % name)
            with open(os.path.join(ROOT, "examples", name, "main.go")) as f:
                self.assertIn('"%s %s"' % (name, argv[1]), f.read(), "kvshare has no subcommand %s" % argv[1])

    def test_c_example(self):
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            self.skipTest("no C compiler")
        libdir = os.path.dirname(_lib.library_path())
        exe = os.path.join(tempfile.mkdtemp(), "share-c")
        run(self, [cc, "-Wall", "-Werror", "-Icapi", "examples/c/share.c", "-L" + libdir, "-lcudapool",
                   "-Wl,-rpath," + libdir, "-o", exe])
        out = run(self, [exe])
        self.assertIn('read "hello from a C producer"', out)
        self.assertIn("producer: the consumer read the greeting", out)


if __name__ == "__main__":
    unittest.main()
