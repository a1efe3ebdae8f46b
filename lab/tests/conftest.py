"""The lab's tests get the session every suite gets (testkit.pytest_session: a home of their own, their skips
recorded for CI); they share no fixture with tests/, and import neither it nor it them."""

pytest_plugins = ("testkit.pytest_session",)
