"""``python -m fastdp info`` and the doctor name the test device as the accelerator, with its
device count. Its own process: ``python -m pytest tests/accel``."""

from __future__ import annotations

import accel
import fastdp
from fastdp.commands.doctor import doctor, format_report
from fastdp.commands.info import format_info

NAME = accel.enable(3)


def test_info_names_the_accelerator_and_its_devices():
    d = fastdp.info()
    assert (d["accelerator"], d["accelerator_devices"]) == (NAME, 3)
    assert f"  accelerator        {NAME}, 3 devices" in format_info(d).splitlines()


def test_the_doctor_names_the_accelerator():
    report = doctor(only="no check has this name")
    assert report["info"]["accelerator"] == NAME and report["checks"] == []
    assert f"accelerator: {NAME}, 3 devices" in format_report(report).splitlines()
