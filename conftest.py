pytest_plugins = ["tests.support.testing", "tests.support.checkpoints", "tests.support.openai_cluster"]
