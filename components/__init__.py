"""Dynamo graph components of maru-dynamo (installed as `maru_dynamo.components`)."""
