pytest_plugins = ["common.testing"]
