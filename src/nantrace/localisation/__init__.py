"""Localisation: replay a failing step op by op and find the origin of the first bad value."""
