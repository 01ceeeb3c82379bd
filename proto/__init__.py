"""The qmill wire contract (package qmill.v1) and its generated stubs, under qmill.proto.v1."""
