"""The CUDA backend's kernel files (accelerated/cuda/kernels/*.cu) and the module
source assembled from them, without a GPU or a compiler: every file is
assembled once, in order, behind a #line directive that gives each line its
real file and number; every kernel the launchers call is defined once and
every defined kernel is launched; the launchers' constants are the
source's; a swapped file replaces exactly one file; dev/ holds no copy of a
production kernel file. Compiling the source is checked on the device
(tests/cuda/) and by dev/cuda/nvrtc_check.py."""

import fnmatch
import importlib
import os
import re

import pytest

from coppelius.accelerated.cuda import attention_fused
from coppelius.accelerated.cuda import compile
from coppelius.accelerated.cuda import gemm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRECTIVE = re.compile(r'#line 1 "(.+)"$')


def read(name):
    with open(os.path.join(compile.KERNEL_DIR, name), encoding="utf-8") as f:
        return f.read()


def test_the_package_ships_exactly_the_assembled_files():
    shipped = sorted(n for n in os.listdir(compile.KERNEL_DIR)
                     if n.endswith((".cu", ".cuh")))
    # the step's module and the product kernel's (gemm.py: sm_90a, compiled apart)
    assert shipped == sorted(set(compile.FILES) | set(gemm.FILES))
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["coppelius.accelerated.cuda"]
    for name in set(compile.FILES) | set(gemm.FILES):
        assert any(fnmatch.fnmatch(f"kernels/{name}", g) for g in globs), (name, globs)


def test_each_line_of_the_module_is_its_file_line_after_the_directive():
    """What NVRTC reports as file(line) is that line of that file."""
    lines = compile.module_source().split("\n")
    files, where = [], None
    for line in lines:
        m = DIRECTIVE.match(line)
        if m:
            files.append(m.group(1))
            where, text, n = m.group(1), read(os.path.basename(m.group(1))).split("\n"), 0
            continue
        n += 1
        assert where is not None, "source before the first #line directive"
        assert n <= len(text) and line == text[n - 1], (where, n, line)
    assert files == [f"accelerated/cuda/kernels/{name}" for name in compile.FILES]


def kernel_definitions(source):
    """Names of extern "C" kernels defined in source, the macro-made entry
    points included: one set per use of a `#define <NAME>_KERNELS(<P>)` macro
    (the fused attention's per head dim, the layernorm's per row width),
    each kernel named `<prefix>##<P>` in the macro."""
    names = []
    # a macro: its #define line, the lines continued by a backslash, the last one
    for macro in re.finditer(r"#define (\w+_KERNELS)\((\w+)\)(?:.*\\\n)*.*", source):
        name, param = macro.group(1), macro.group(2)
        prefixes = re.findall(rf"(\w+)##{param}\(", macro.group(0))
        for value in re.findall(rf"^{name}\((\d+)\)$", source, re.M):
            names += [f"{prefix}{value}" for prefix in prefixes]
        source = source.replace(macro.group(0), "")
    return names + re.findall(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?'
                              r'(\w+)\(', source)


def test_every_launched_kernel_is_defined_once_and_every_kernel_launched():
    names = kernel_definitions(compile.module_source())
    assert sorted(names) == sorted(compile.KERNELS)
    fused = {int(n.rsplit("_e", 1)[1]) for n in names if re.fullmatch(r"attention_.*_e\d+", n)}
    assert fused == set(attention_fused.ATTENTION_HEAD_DIMS)


@pytest.mark.parametrize("constant,file,define", [
    ("EMBEDDING_THREADS", "embedding.cu", "EMB_THREADS"),
    ("LN_CHUNKS", "layernorm.cu", "LN_CHUNKS"),
    ("LAYERNORM_WARPS", "layernorm.cu", "LN_WARPS"),
    ("LAYERNORM_GROUPS", "layernorm.cu", "LN_GROUPS"),
    ("LINEAR_BIAS_GROUPS", "linear_bias.cu", "LB_GROUPS"),
    ("CE_THREADS", "crossentropy.cu", "CE_THREADS"),
    ("ATTENTION_TILE", "attention_fused.cu", "ATT_TILE"),
])
def test_launcher_constants_are_the_sources(constant, file, define):
    """Each constant of a family's launchers (accelerated/cuda/<family>.py) is
    its kernel file's (kernels/<family>.cu)."""
    m = re.search(rf"^#define {define} (\d+)\b", read(file), re.M)
    assert m, f"{file}: no #define {define}"
    launchers = family(file)
    assert getattr(launchers, constant) == int(m.group(1)), (constant, file, m.group(0))


def family(file):
    """The launcher module of a kernel file's family: the file's name."""
    return importlib.import_module(f"coppelius.accelerated.cuda.{file.rsplit('.', 1)[0]}")


def test_each_family_launches_the_kernels_of_its_own_file():
    """One name per kernel family: the kernels a family's launcher module
    lists (its KERNELS) are those its kernel file defines."""
    for file in compile.FILES:
        if file.endswith(".cu"):
            assert sorted(kernel_definitions(read(file))) == sorted(family(file).KERNELS), file


def test_replace_swaps_one_whole_file(tmp_path):
    variant = tmp_path / "v9.cu"
    variant.write_text("// a variant of the fused attention\n")
    source = compile.module_source({"attention_fused.cu": str(variant)})
    label = str(variant).replace("\\", "/")
    assert f'#line 1 "{label}"\n// a variant of the fused attention\n' in source
    assert '"accelerated/cuda/kernels/attention_fused.cu"' not in source
    assert read("attention_fused.cu") not in source
    others = [n for n in compile.FILES if n != "attention_fused.cu"]
    assert all(f'#line 1 "accelerated/cuda/kernels/{n}"\n{read(n)}' in source for n in others)
    with pytest.raises(ValueError, match="attention.cuh"):
        compile.module_source({"attention.cuh": str(variant)})


def dev_kernel_files():
    for folder, _, names in os.walk(os.path.join(ROOT, "dev")):
        for name in sorted(names):
            if name.endswith((".cu", ".cuh")):
                yield os.path.join(folder, name)


def test_dev_holds_no_copy_of_a_production_kernel_file():
    production = {name: read(name) for name in compile.FILES}
    for path in dev_kernel_files():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        same = [n for n, t in production.items() if t.strip() == text.strip()]
        assert not same, (f"{os.path.relpath(path, ROOT)} is a copy of "
                          f"accelerated/cuda/kernels/{same[0]}")


def test_attention_variants_replace_the_fused_file_whole():
    """Each dev/cuda/attention/v*.cu defines the entry points of
    attention_fused.cu, so the harness can swap the whole file."""
    want = sorted(kernel_definitions(read("attention_fused.cu")))
    variants = sorted(p for p in dev_kernel_files()
                      if re.fullmatch(r"v\d+\.cu", os.path.basename(p))
                      and os.path.basename(os.path.dirname(p)) == "attention")
    assert variants
    for path in variants:
        with open(path, encoding="utf-8") as f:
            assert sorted(kernel_definitions(f.read())) == want, path


def test_every_kernel_waits_for_the_one_before_it_first():
    """Each kernel is launched allowed to start before the kernel ahead of
    it in the stream has ended (accelerated/cuda/dependent_launch.py), so
    its first statement must be AFTER_PRIOR_GRIDS(): a kernel reading or
    writing before it would race with its predecessor. Every __global__
    definition of every file of both modules, macro bodies included."""
    for name in sorted(set(compile.FILES) | set(gemm.FILES)):
        text = read(name)
        kernels = list(re.finditer(r"__global__", text))
        if name.endswith(".cu"):
            assert kernels, name
        for m in kernels:
            body = text.index("{", m.end())
            first = text[body + 1:].lstrip(" \\\n")
            line = text.count("\n", 0, m.start()) + 1
            assert first.startswith("AFTER_PRIOR_GRIDS();"), \
                f"{name}:{line}: a kernel whose first statement is {first[:40]!r}"
    common = read("common.cuh")
    assert "griddepcontrol.wait;" in common and "griddepcontrol.launch_dependents;" in common
    # the wait comes first in the one asm statement: a kernel's dependents
    # are let go only after it has itself waited
    assert common.index("griddepcontrol.wait;") < common.index("griddepcontrol.launch_dependents;")
