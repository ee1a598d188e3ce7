#!/usr/bin/env python3
"""Renders kustomizations with kustomize's own Go library, as PyPI's `pykustomize` wheel ships it
(sigs.k8s.io/kustomize/api v0.21.3, i.e. the `kustomize build` of kustomize 5.8), called
directly through ctypes so the wheel's Python >= 3.14 wrapper is not needed.

    render.py LIBPYKUSTOMIZE_SO OUT_DIR NAME=DIR [NAME=DIR ...]

writes OUT_DIR/NAME.yaml for each kustomization DIR; exits 1 naming the first that fails.
Used by infra/local/validate-deploy.sh."""

import ctypes
import json
import pathlib
import sys


def main() -> int:
    lib_path, out_dir, *targets = sys.argv[1:]
    lib = ctypes.CDLL(lib_path)
    lib.pykustomize_build.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    lib.pykustomize_build.restype = ctypes.c_int
    lib.pykustomize_last_error.restype = ctypes.c_void_p
    # load_restrictions 0: files only from inside each kustomization root (kustomize's default)
    options = json.dumps(
        {
            "load_restrictions": 0,
            "reorder": "unspecified",
            "add_managedby_label": False,
            "enable_plugins": False,
            "enable_helm": False,
            "helm_command": "",
        }
    ).encode()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for target in targets:
        name, _, directory = target.partition("=")
        result = ctypes.c_void_p()
        rc = lib.pykustomize_build(directory.encode(), options, ctypes.byref(result))
        if rc != 0:
            err = lib.pykustomize_last_error()
            message = ctypes.string_at(err).decode() if err else "unknown error"
            print(f"render: {name} ({directory}): {message}", file=sys.stderr)
            return 1
        yaml_text = ctypes.string_at(result.value).decode()
        (out / f"{name}.yaml").write_text(yaml_text)
        objects = yaml_text.count("\nkind: ")
        print(f"render: {name}: {objects} objects", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
