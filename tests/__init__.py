"""Tests, a package: its folders mirror mdtrain's packages; shared helpers are in
``tests.helpers`` (``from tests.helpers.datagen import ...``), never in a test module."""
