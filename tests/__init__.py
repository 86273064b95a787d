"""Tests; a package so that tests can share helpers: ``from tests.datagen import ...``."""
