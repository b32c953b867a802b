"""Responses to an incident: which action a policy takes."""
