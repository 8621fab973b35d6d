"""The doctor's torch_npu / CANN pair check, on real version files in a temporary directory standing for the Ascend
install root (/usr/local/Ascend): the files the CANN installers write (``<arch>-linux/ascend_toolkit_install.info``
under ascend-toolkit/latest up to CANN 8.3, under cann from 8.5.0; ``version.cfg``), read by the doctor's own code.
Each case pairs the finding with its opposite on the same files, so a check that says nothing, or says the same
thing whatever it reads, fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import doctor

ARCH = "aarch64"


def install_cann(root: Path, version: str, layout: str = "ascend-toolkit/latest") -> Path:
    """A CANN toolkit's install record under ``root``, as its installer writes it."""
    info = root / layout / f"{ARCH}-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True, exist_ok=True)
    info.write_text(f"package_name=Ascend-cann-toolkit\nversion={version}\ninnerversion=V100R001C23\narch={ARCH}\n"
                    f"os=linux\npath={info.parent}\n")
    return info


def check(torch_npu: str | None, root: Path) -> list[str]:
    return doctor.check_cann_pair(torch_npu, {}, ascend_root=str(root), arch=ARCH)


def test_the_table_parses_and_names_each_build_once():
    builds = [n for b in doctor.TORCH_NPU_CANN_PAIRS.values() for n in b]
    assert all(doctor.cann_key(c) for c in doctor.TORCH_NPU_CANN_PAIRS), doctor.TORCH_NPU_CANN_PAIRS
    assert all(doctor.torch_npu_key(n) for n in builds) and len(set(builds)) == len(builds), builds
    assert doctor.cann_key("8.0.RC3") < doctor.cann_key("8.0.0") < doctor.cann_key("8.1.RC1") < doctor.cann_key("9.1.0")
    assert doctor.cann_key("6.3.RC3") < doctor.cann_key("6.3.RC3.1") < doctor.cann_key("7.0.RC1")
    assert doctor.torch_npu_key("2.1.0.rc1") < doctor.torch_npu_key("2.1.0") < doctor.torch_npu_key("2.1.0.post17")


@pytest.mark.parametrize("torch_npu, cann, layout", [
    ("2.7.1.post2", "8.5.0", "cann"),                     # CANN 8.5.0 and later: /usr/local/Ascend/cann
    ("2.6.0.post3", "8.3.RC1", "ascend-toolkit/latest"),  # up to 8.3: ascend-toolkit/latest
    ("2.12.0", "9.1.0", "cann"),
    ("2.1.0.post4", "8.0.RC1", "ascend-toolkit/latest"),  # the historical table
])
def test_a_published_pair_passes(tmp_path, torch_npu, cann, layout):
    install_cann(tmp_path, cann, layout)
    assert check(torch_npu, tmp_path) == []
    # The same files with a build published for another CANN only: the check reads them and refuses it.
    pairs = doctor.TORCH_NPU_CANN_PAIRS
    other = next(n for c, builds in pairs.items() if c != cann for n in builds if n not in pairs[cann])
    assert check(other, tmp_path)[0].startswith(doctor.ERROR), other


def test_a_mismatched_pair_fails_with_the_line_that_fixes_it(tmp_path):
    info = install_cann(tmp_path, "8.5.0", "cann")
    # torch_npu 2.7.1.post8 is CANN 9.1.0's build; CANN 8.5.0 has its own build for torch 2.7.1.
    [finding] = check("2.7.1.post8", tmp_path)
    assert finding.startswith(doctor.ERROR) and doctor.exit_code([finding]) == doctor.EXIT_ERROR
    assert "torch_npu 2.7.1.post8 is published for CANN 9.1.0, but CANN 8.5.0 is installed" in finding, finding
    assert str(info) in finding and "pip install torch_npu==2.7.1.post2" in finding, finding
    # No build of torch 2.12 for CANN 8.5.0: upgrade CANN, or the newest torch / torch_npu pair CANN 8.5.0 has.
    [finding] = check("2.12.0", tmp_path)
    assert finding.startswith(doctor.ERROR), finding
    assert "install CANN 9.1.0, or for CANN 8.5.0: pip install torch==2.9.0 torch_npu==2.9.0" in finding, finding
    assert check("2.9.0", tmp_path) == []  # what the line says to install passes


def test_a_version_newer_than_the_table_is_an_unknown_pair_not_a_failure(tmp_path):
    install_cann(tmp_path, "9.1.0", "cann")
    [finding] = check("2.13.0", tmp_path)  # this project's torch: no torch_npu 2.13 in the table yet
    assert finding.startswith(doctor.WARNING) and "unknown pair: torch_npu 2.13.0 is newer than" in finding, finding
    [finding] = check("2.12.0.post3", tmp_path)  # a later build of a release the table has
    assert finding.startswith(doctor.WARNING) and "unknown pair" in finding, finding
    newer = tmp_path / "newer"
    install_cann(newer, "9.2.0", "cann")
    [finding] = check("2.12.0", newer)  # a published torch_npu on a CANN newer than the table
    assert finding.startswith(doctor.WARNING) and "unknown pair: CANN 9.2.0" in finding, finding
    assert "torch_npu 2.12.0 is published for CANN 9.1.0" in finding, finding
    assert doctor.exit_code([finding]) == doctor.EXIT_OK
    # An older CANN than the build's is no unknown pair: it is a mismatch.
    older = tmp_path / "older"
    install_cann(older, "8.0.0", "cann")
    assert check("2.12.0", older)[0].startswith(doctor.ERROR)


def test_an_absent_or_unreadable_version_file_says_what_is_missing(tmp_path):
    [finding] = check("2.12.0", tmp_path)  # nothing installed under the root
    assert finding.startswith(doctor.WARNING) and "CANN's version could not be read" in finding, finding
    assert f"no <arch>-linux/ascend_toolkit_install.info or version.cfg under {tmp_path}/ascend-toolkit/latest, " \
           f"{tmp_path}/cann" in finding, finding
    # A record with no version line, and a version.cfg that cannot be read (a directory where the file should be).
    info = tmp_path / "cann" / f"{ARCH}-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir(parents=True)
    info.write_text("package_name=Ascend-cann-toolkit\narch=aarch64\n")
    (tmp_path / "cann" / "version.cfg").mkdir()
    [finding] = check("2.12.0", tmp_path)
    assert f"{info} has no version line" in finding, finding
    assert f"{tmp_path}/cann/version.cfg is unreadable (IsADirectoryError" in finding, finding
    assert check(None, tmp_path) == []  # no torch_npu: no pair to check
    info.write_text("version=9.1.0\n")  # the record readable: the pair is checked, and passes
    assert check("2.12.0", tmp_path) == []


def test_the_variables_root_comes_first_and_the_report_shows_driver_and_firmware(tmp_path):
    install_cann(tmp_path, "9.1.0", "cann")
    elsewhere = tmp_path / "opt" / "cann-8.5.0"
    install_cann(elsewhere, "8.5.0", ".")
    found = doctor.read_cann({"ASCEND_HOME_PATH": str(elsewhere)}, str(tmp_path), ARCH)
    assert found.version == "8.5.0" and found.source.startswith(str(elsewhere)), found
    assert doctor.read_cann({}, str(tmp_path), ARCH).version == "9.1.0"
    # Driver and firmware: read and shown (no published table to check them against).
    (tmp_path / "driver").mkdir()
    (tmp_path / "driver" / "version.info").write_text("Version=25.2.0\nascendhal_version=7.35.23\n")
    (tmp_path / "firmware").mkdir()
    (tmp_path / "firmware" / "version.info").write_text("Version=7.7.0.6.236\n")
    facts = doctor.ascend_facts({}, ascend_root=str(tmp_path))
    assert (facts["driver"], facts["firmware"]) == ("25.2.0", "7.7.0.6.236"), facts
    assert (doctor.ascend_facts({}, ascend_root=str(tmp_path / "none"))["firmware"]) is None
