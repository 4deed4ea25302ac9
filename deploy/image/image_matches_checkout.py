#!/usr/bin/env python3
"""Whether the packages installed in the image are this checkout's files.

    podman run --rm --entrypoint /opt/attnserve/bin/python IMAGE -c "$(cat LISTER)" \
        | python3 deploy/image/image_matches_checkout.py

stdin: one ``<sha256> <path>`` line per file of the installed packages, the path
relative to site-packages (what ``--print-lister`` prints is a program that lists
them inside the image). The checkout's side comes from the pyproject.toml of the
distribution the image installs from this checkout (``attnserve``: the server and
the client package, ``attnserve_client``): each package's folder (``package-dir``),
its ``*.py`` files and its ``package-data``.
Exit 0 when both sides hold the same files with the same contents, else 1 with
the differences.

Why: podman (buildah 1.28) does not count the stage mounted by ``RUN
--mount=type=bind,from=builder`` in its layer cache key, so after a change of the
sources a cached build can keep the previous wheels. deploy/test-image.sh checks
every build with this and rebuilds without the cache when it fails.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]

# A compiled extension is listed as its C sources with the SHA-256 that its build
# embedded (setup.py): each file's in SOURCES (its name beside the module: the call
# frame's _callframe.c, callframe.c, callframe.h), else SOURCE_DIGEST as the
# module's own .c. The image holds the module, the checkout the sources.
LISTER = """
import hashlib, importlib.machinery, importlib.util, os, sys, sysconfig
site = sys.argv[1] if len(sys.argv) > 1 else sysconfig.get_paths()["purelib"]
for top in ("attnserve", "attnserve_client"):
    for folder, dirs, files in os.walk(os.path.join(site, top)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = os.path.join(folder, name)
            suffix = next((s for s in importlib.machinery.EXTENSION_SUFFIXES if name.endswith(s)), None)
            if suffix:
                spec = importlib.util.spec_from_file_location(name[: -len(suffix)], path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sources = getattr(module, "SOURCES", None) or {name[: -len(suffix)] + ".c": module.SOURCE_DIGEST}
                for source, digest in sources.items():
                    print(digest, os.path.relpath(os.path.join(folder, source), site))
                continue
            digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
            print(digest, os.path.relpath(path, site))
"""


# the folders of the distributions the image installs, each with its own pyproject.toml
PROJECTS = (ROOT,)


def checkout_files() -> dict[str, str]:
    """{path in site-packages: sha256} of what the wheels should install."""
    out: dict[str, str] = {}
    for project in PROJECTS:
        for rel, digest in project_files(project).items():
            if rel in out:
                raise SystemExit(f"{rel}: shipped by two distributions")
            out[rel] = digest
    return out


def project_files(project: Path) -> dict[str, str]:
    """{path in site-packages: sha256} of what the wheel built from ``project`` installs."""
    setup = tomllib.loads((project / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir: dict[str, str] = setup.get("package-dir", {})
    data: dict[str, list[str]] = setup.get("package-data", {})
    out: dict[str, str] = {}
    for package in setup["packages"]:
        # the folder of a package: its own package-dir entry, else its parent's + name
        parts = package.split(".")
        for i in range(len(parts), 0, -1):
            base = ".".join(parts[:i])
            if base in package_dir:
                folder = project / package_dir[base] / Path(*parts[i:])
                break
        else:
            folder = project / Path(*parts)
        target = Path(*parts)
        # *.c, *.h: an extension's sources, which the image lists for its module
        # (LISTER); *.pyi: its typed interface, which setuptools ships beside it
        patterns = ["*.py", "*.pyi", "*.c", "*.h", *data.get(package, [])]
        for pattern in patterns:
            for path in folder.glob(pattern):
                if path.is_file():
                    rel = (target / path.relative_to(folder)).as_posix()
                    out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def main() -> int:
    if sys.argv[1:] == ["--print-lister"]:
        print(LISTER)
        return 0
    image: dict[str, str] = {}
    for line in sys.stdin:
        if line.strip():
            digest, path = line.split(maxsplit=1)
            image[path.strip()] = digest
    # What pip adds besides the package files (none today) would show up here.
    want = checkout_files()
    missing = sorted(set(want) - set(image))
    extra = sorted(p for p in set(image) - set(want) if not p.endswith((".pyc",)))
    changed = sorted(p for p in set(want) & set(image) if want[p] != image[p])
    if missing or extra or changed:
        for what, paths in (
            ("missing from the image", missing),
            ("only in the image", extra),
            ("different in the image", changed),
        ):
            if paths:
                print(f"{what}: {', '.join(paths[:12])}{' ...' if len(paths) > 12 else ''}")
        return 1
    print(f"ok -- the image's attnserve and attnserve_client are this checkout's {len(want)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
