"""cudapool's build backend (PEP 517), with the standard library alone: a stock python3
and its pip install the package, with or without --no-build-isolation, with no package
registry and no setuptools or wheel package (setuptools before 70.1 cannot build a wheel
without the wheel package: "invalid command 'bdist_wheel'").

The wheel holds the package (cudapool/) and the library beside it: $CUDAPOOL_LIB if
set, else ../bin/libcudapool.so, where the README's build puts it; without either it
holds the package alone, which finds the library through $CUDAPOOL_LIB at run time. With
the library in it the wheel is tagged for this platform, else for any.
"""

import base64
import hashlib
import io
import os
import sysconfig
import tarfile
import zipfile

NAME = "cudapool"
VERSION = "1.0.0"
METADATA = """Metadata-Version: 2.1
Name: {name}
Version: {version}
Summary: Share GPU memory between processes through CUDA IPC memory pools, with leases and stream ordering
License: Apache-2.0
Requires-Python: >=3.9
Provides-Extra: torch
Requires-Dist: torch; extra == "torch"
Provides-Extra: hf
Requires-Dist: torch; extra == "hf"
Requires-Dist: transformers; extra == "hf"
Requires-Dist: triton; extra == "hf"
""".format(name=NAME, version=VERSION)

HERE = os.path.dirname(os.path.abspath(__file__))
DIST_INFO = "%s-%s.dist-info" % (NAME, VERSION)


def _library():
    """The library to put beside the package, or None."""
    lib = os.environ.get("CUDAPOOL_LIB") or os.path.join(HERE, "..", "bin", "libcudapool.so")
    return lib if os.path.isfile(lib) else None


def _package_files():
    """(path in the wheel, path here) of the package's files, in name order."""
    pkg = os.path.join(HERE, NAME)
    names = sorted(n for n in os.listdir(pkg) if n.endswith(".py") or n == "py.typed")
    return [("%s/%s" % (NAME, n), os.path.join(pkg, n)) for n in names]


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _tag(platform_specific):
    if not platform_specific:
        return "py3-none-any"
    return "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (path, digest, len(data))


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    """Writes the wheel into wheel_directory and returns its file name."""
    files = [(arc, _read(path)) for arc, path in _package_files()]
    lib = _library()
    if lib is not None:
        files.append(("%s/libcudapool.so" % NAME, _read(lib)))
    tag = _tag(lib is not None)
    wheel = "Wheel-Version: 1.0\nGenerator: cudapool _build.py\nRoot-Is-Purelib: %s\nTag: %s\n" % (
        "false" if lib is not None else "true", tag)
    files += [(DIST_INFO + "/METADATA", METADATA.encode()), (DIST_INFO + "/WHEEL", wheel.encode())]
    record = [_record_line(arc, data) for arc, data in files] + [DIST_INFO + "/RECORD,,"]
    files.append((DIST_INFO + "/RECORD", ("\n".join(record) + "\n").encode()))
    name = "%s-%s-%s.whl" % (NAME, VERSION, tag)
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in files:
            info = zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if arc.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return name


def build_sdist(sdist_directory, config_settings=None):
    """Writes the source archive (the package, this backend, pyproject.toml; not the
    library) into sdist_directory and returns its file name."""
    base = "%s-%s" % (NAME, VERSION)
    members = [("pyproject.toml", os.path.join(HERE, "pyproject.toml")), ("_build.py", os.path.join(HERE, "_build.py"))]
    members += _package_files()
    name = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", format=tarfile.PAX_FORMAT) as t:
        pkg_info = METADATA.encode()
        for arc, data in [("PKG-INFO", pkg_info)] + [(a, _read(p)) for a, p in members]:
            info = tarfile.TarInfo("%s/%s" % (base, arc))
            info.size, info.mode = len(data), 0o644
            t.addfile(info, io.BytesIO(data))
    return name
