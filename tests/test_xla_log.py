"""XLA's rematerialisation warning, written from C++ to file descriptor 2, becomes one line of
ours; every other line on the descriptor passes through unchanged."""

import logging
import os

import pytest

from ulysses_jax import xla_log

REMAT = (b"W1124 14:13:09.815749   30646 hlo_rematerialization.cc:3402] Can't reduce memory use "
         b"below 83.63GiB (89795223790 bytes) by rematerialization; only reduced to 108.56GiB "
         b"(116565132608 bytes), down from 110.81GiB (118979082592 bytes) originally\n")
OTHER = b"W1124 14:13:10.000001   30646 gpu_compiler.cc:1] some other XLA warning\n"


@pytest.fixture(autouse=True)
def not_yet_explained(monkeypatch):
  monkeypatch.setattr(xla_log, "_explained", False)


def test_the_warning_is_explained_once_and_others_pass_through(capfd, caplog):
  with caplog.at_level(logging.WARNING, logger="ulysses_jax"):
    for _ in range(2):
      with xla_log.remat_warning_explained():
        os.write(2, OTHER + REMAT)
  err = capfd.readouterr().err
  assert err == OTHER.decode() * 2
  explained = [r.getMessage() for r in caplog.records if r.name == "ulysses_jax.xla_log"]
  assert explained == [xla_log.explanation("83.63GiB", "108.56GiB")]
  assert "could not bring its memory estimate of the step below 83.63GiB" in explained[0]


def test_where_the_limit_is_lowered_on_purpose_it_is_dropped_unexplained(capfd, caplog):
  with caplog.at_level(logging.WARNING, logger="ulysses_jax"):
    with xla_log.remat_warning_explained(explain=False):
      os.write(2, REMAT + OTHER)
  assert capfd.readouterr().err == OTHER.decode()
  assert not caplog.records


def test_stderr_comes_back_after_an_exception(capfd):
  with pytest.raises(RuntimeError, match="compile failed"):
    with xla_log.remat_warning_explained():
      os.write(2, OTHER)
      raise RuntimeError("compile failed")
  os.write(2, b"after\n")
  assert capfd.readouterr().err == OTHER.decode() + "after\n"
