"""Graph descriptions of maru-dynamo (installed as `maru_dynamo.graphs`)."""
