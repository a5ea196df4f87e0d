"""Helpers shared by tests (fakes, loopbacks); no tests here."""
