"""Builds rannc: setup.py drives CMake, which builds the extension rannc._C against the
installed torch (found through torch.utils.cmake_prefix_path, with torch's pybind11).

Install with `pip install --no-build-isolation .` so that pip does not fetch another torch.
The CMake build directory is build/py (kept between builds: incremental, with ccache).
"""
import os
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
        build_dir = os.path.join(ROOT, "build", "py")
        os.makedirs(build_dir, exist_ok=True)
        generator = ["-G", "Ninja"] if _has("ninja") else []
        subprocess.check_call(
            ["cmake", "-S", ROOT, "-B", build_dir, *generator,
             f"-DPython_EXECUTABLE={sys.executable}",
             f"-DRANNC_PYTHON_OUT={out_dir}",
             f"-DCMAKE_BUILD_TYPE={os.environ.get('RANNC_BUILD_TYPE', 'Release')}",
             "-DRANNC_WITH_TORCH=ON"])
        jobs = os.environ.get("RANNC_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", build_dir, "--target", "_C", "-j", jobs])


def _has(program):
    from shutil import which
    return which(program) is not None


setup(
    name="rannc",
    version="0.1.0",
    description="Automatic hybrid (pipeline + data) parallelism for PyTorch models",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("rannc._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    install_requires=["torch"],
    zip_safe=False,
)
