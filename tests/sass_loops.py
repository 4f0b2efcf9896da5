"""The main loop of a kernel's SASS (as `nvdisasm -c` prints it) and checks on its WGMMAs."""

import re


def main_loop(sass: str) -> list:
    """The instructions of the shortest loop (a branch back to a label) that issues HGMMAs."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m[1]] = len(instructions)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line):
            instructions.append(m[1])
    loop = []
    for i, text in enumerate(instructions):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
        if m and labels.get(m[1], i + 1) <= i:
            body = instructions[labels[m[1]]:i + 1]
            if any("HGMMA" in x for x in body) and (not loop or len(body) < len(loop)):
                loop = body
    return loop


def descriptors_moved_from_thread_registers(loop: list) -> int:
    """The HGMMAs of `loop` (in program order) one of whose descriptor registers (gdesc[URn]:
    URn to URn+3) was last written by an R2UR, a move from a per-thread register: a descriptor
    that ptxas could not keep uniform and rebuilds per thread."""
    writer, moved = {}, 0
    for text in loop:
        opcode, _, operands = re.sub(r"^@!?U?P\w+\s+", "", text).partition(" ")
        if "HGMMA" in opcode:
            if m := re.search(r"gdesc\[UR(\d+)\]", operands):
                moved += any(writer.get(r) == "R2UR" for r in range(int(m[1]), int(m[1]) + 4))
        elif m := re.match(r"UR(\d+)\b", operands.strip()):
            for r in range(int(m[1]), int(m[1]) + (2 if ".64" in opcode else 1)):
                writer[r] = opcode.split(".")[0]
    return moved


def sass_opcode_counts(configs, compile_config, tmp_path) -> dict:
    """{config name: SASS opcode counts} of `configs` built for sm_90a by `compile_config(config,
    options)`, each checked to compile without spills; skips the test without the SASS tools."""
    import pytest

    from cute_flash import audit

    if audit.find_tool("nvdisasm") is None or audit.find_tool("cuobjdump") is None:
        pytest.skip("nvdisasm/cuobjdump not installed (test extra)")
    counts = {}
    for config in configs:
        target = audit.AuditTarget(config.name, "sm_90a", lambda options, c=config: compile_config(c, options))
        row = audit.audit_target(target, keep_dir=tmp_path)
        assert row.error is None and not row.spills, (config.name, row.error, row.spill_stores, row.spill_loads)
        counts[config.name] = audit.count_sass((tmp_path / config.name / "kernel.sass").read_text())
    return counts
