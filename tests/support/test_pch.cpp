// The origin of the tests' precompiled header (tests/support/test_pch.hpp); it runs nothing.
int main() { return 0; }
