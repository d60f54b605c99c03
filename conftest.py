pytest_plugins = ["tests.support.testing", "tests.support.checkpoints"]
