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


def run(test, argv, **env):
    e = dict(os.environ, **env)
    out = subprocess.run(argv, cwd=ROOT, env=e, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    test.assertEqual(out.returncode, 0, "%s failed:\n%s%s" % (argv, out.stdout, out.stderr))
    return out.stdout


class ExamplesTest(unittest.TestCase):
    def test_python_example(self):
        out = run(self, [sys.executable, "examples/python/share.py"], PYTHONPATH=os.path.join(ROOT, "python"))
        self.assertIn("consumer read 'hello from a Python producer'", out)

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
