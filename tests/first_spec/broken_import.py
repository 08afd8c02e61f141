import team_internal_sdk_not_installed  # noqa: F401
